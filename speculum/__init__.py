"""speculum: speculative decoding for PyTorch as pure functions over frozen state records."""

__version__ = "0.1.0"


def generate(*args, **kwargs):
    """Shortcut for :func:`speculum.runtime.generate.generate` (imported lazily: importing
    ``speculum.state`` alone must not pull in models and pipelines)."""
    from speculum.runtime.generate import generate as _generate

    return _generate(*args, **kwargs)
