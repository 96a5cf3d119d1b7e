"""Using a trained detector outside training: backends, pre- and post-processing, export."""
