"""The shared core of the detection pipeline; its layers are the import-linter contracts in ``pyproject.toml``."""
