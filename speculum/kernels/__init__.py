"""Fast twins of ``spec`` functions, registered as ``torch.library`` custom ops.

Every op's default kernel is its ``spec`` twin (or, for the decoder's elementwise ops, a
pure-torch reference with the decoder's exact math), so pipelines call one name on any device.
On a CUDA machine the Triton kernels register as the ops' CUDA kernels when this package is
imported; each is checked against its twin by parity tests (``tests/cover/test_kernel_*`` under
Triton's interpreter, ``tests/gpu/test_kernel_*`` on the device).

Where Triton is not installed, CUDA tensors run the reference kernels (correct, slow) and a
warning says so; :data:`DEVICE_KERNELS` names the path that runs.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from speculum.kernels import fp8, half, model_ops
from speculum.kernels.attention import latent_attention, paged_attention, write_kv
from speculum.kernels.recurrent import gated_delta_rule, mamba2_scan

__all__ = [
    "DEVICE_KERNELS",
    "fp8",
    "gated_delta_rule",
    "half",
    "latent_attention",
    "mamba2_scan",
    "model_ops",
    "paged_attention",
    "register_device_kernels",
    "write_kv",
]

#: The Triton modules whose ``register()`` installs CUDA kernels for speculum's ops.
TRITON_MODULES = (
    "triton_attention",
    "triton_mla",
    "triton_model_ops",
    "triton_recurrent",
    "triton_sampling",
    "triton_tree",
)
#: Modules whose ``register()`` installs CUDA kernels that run without Triton (``fp8`` and
#: ``half`` use its matrix-vector kernel where it is installed, torch's matmuls elsewhere).
TORCH_CUDA_MODULES = ("grouped_moe", "fp8", "half")


def register_device_kernels() -> str:
    """Install the CUDA kernels of speculum's ops (Triton's, and the grouped-GEMM MoE and the
    FP8 and half-precision linear layers, which run without Triton too); returns the path
    that CUDA tensors take: ``"triton"``, or ``"reference"`` (with a warning) where Triton is
    missing."""
    for name in TORCH_CUDA_MODULES:
        importlib.import_module(f"speculum.kernels.{name}").register()
    try:
        import triton  # noqa: F401
    except ImportError:
        warnings.warn(
            "Triton is not installed: on CUDA, speculum runs its reference kernels (correct but "
            "several times slower); install it with `pip install triton`",
            stacklevel=2,
        )
        return "reference"
    for name in TRITON_MODULES:
        importlib.import_module(f"speculum.kernels.{name}").register()
    return "triton"


#: Which kernels CUDA tensors run: "triton", "reference" (Triton missing) or "none" (no CUDA).
DEVICE_KERNELS = register_device_kernels() if torch.cuda.is_available() else "none"
