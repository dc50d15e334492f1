"""speculum: speculative decoding for PyTorch as pure functions over frozen state records."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``speculum.generate`` is :func:`speculum.runtime.generate.generate` itself (its own
    signature and docstring), imported on first use: importing ``speculum.state`` alone must
    not pull in models and pipelines."""
    if name == "generate":
        from speculum.runtime.generate import generate

        return generate
    raise AttributeError(f"module 'speculum' has no attribute {name!r}")
