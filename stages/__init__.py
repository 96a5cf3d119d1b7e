"""DVC stages: one thin module each, run as ``python -m stages.<name>`` (train and evaluate via torchrun)."""
