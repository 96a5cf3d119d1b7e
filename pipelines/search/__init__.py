"""Scale-aware AutoAugment's policy search: genomes, the score, the evolution, the proxy fine-tune."""
