"""speculum: speculative decoding for PyTorch as pure functions over frozen state records."""

__version__ = "0.1.0"
