"""Test-suite setup: record constructors are type-checked (jaxtyping + beartype) under pytest."""

import os

# Must be set before speculum's record classes are defined, i.e. before any speculum import.
os.environ.setdefault("SPECULUM_TYPECHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
