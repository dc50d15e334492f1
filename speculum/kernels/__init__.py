"""Fast twins of ``spec`` functions, registered as ``torch.library`` custom ops.

Every op's default kernel is its ``spec`` twin, so pipelines call one name on any device; device
kernels (flashinfer, Triton) register for CUDA and are checked against the twin by parity tests.
"""

from speculum.kernels.attention import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
