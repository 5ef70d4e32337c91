"""Where tensors live and what a device failure means: host→device staging, per-thread device binding,
and which errors leave an accelerator unusable."""

from __future__ import annotations

import threading

import torch

_FATAL_MARKERS = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "ECC error",
)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One copy of a freshly built host tensor that does not block the host: staged in pinned memory and
    copied asynchronously on CUDA (the caching host allocator keeps the staging buffer until the copy has
    run); the tensor itself on the CPU."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for errors after which the device's context is unusable (a device-side assert, an illegal
    address): every later kernel fails too, so the engine must stop instead of serving on."""
    if isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _FATAL_MARKERS)


class DeviceBinding:
    """Makes ``device`` the current CUDA device of every thread that launches kernels on it (``cuda:N`` for
    N ≠ 0 is not the default of a new thread); a no-op elsewhere."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            # "cuda" names the creating thread's current device; a worker thread's own current device is 0,
            # and torch.cuda.set_device refuses an index-less device (torch 2.11 raises), so fix it here
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._bound = threading.local()

    def __call__(self) -> None:
        if self.device.type != "cuda" or getattr(self._bound, "done", False):
            return
        torch.cuda.set_device(self.device.index)
        self._bound.done = True


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a step's wall time measures the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
