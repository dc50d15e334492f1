"""Copies between host and device that do not wait for the work queued on the device.

A plain ``tensor.tolist()`` or ``tensor.to("cuda")`` waits for every kernel queued before it
(PyTorch synchronises the stream around a blocking copy), which is exactly what an overlapped
scheduler must not do. :func:`to_host` queues the device-to-host copy into pinned memory and
records an event; :func:`to_device` stages a host tensor in pinned memory and queues the copy.
On the CPU both are ordinary (synchronous) copies.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

__all__ = ["HostCopy", "to_host", "to_device"]


@attrs.define(frozen=True, slots=True, eq=False)
class HostCopy:
    """A tensor on its way to the host: ``ready()`` says whether it has arrived (never
    blocks), ``get()`` waits for it. ``host`` is written by the queued copy until ``done``
    fires; it is never written again afterwards, so a copy may be read any number of times."""

    host: Tensor
    done: torch.cuda.Event | None = None  # None: already on the host

    def ready(self) -> bool:
        """Whether the copy has finished."""
        return self.done is None or self.done.query()

    def get(self) -> Tensor:
        """The host tensor, once the copy has finished."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


def to_host(x: Tensor) -> HostCopy:
    """Queue a copy of ``x`` to the host behind the work that produces it."""
    if x.device.type != "cuda":
        return HostCopy(x.cpu())
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` (a host tensor) on ``device``, copied without waiting for queued device work."""
    if device.type != "cuda":
        return x.to(device)
    # The caching host allocator keeps the pinned block alive until the copy has run.
    return x.pin_memory().to(device, non_blocking=True)
