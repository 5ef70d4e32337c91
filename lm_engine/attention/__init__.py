"""Attention backends: torch (reference), cpu (torch + a compiled decode kernel) and Triton (CUDA)."""

from __future__ import annotations

from lm_engine.attention.base import AttentionBackend, AttentionMetadata
from lm_engine.attention.torch_backend import CpuBackend, TorchBackend
from runtime import paged_decode


def get_backend(device: str | None = None, name: str = "auto") -> AttentionBackend:
    """``auto``: Triton on CUDA; on the CPU the compiled decode kernel where it builds, else torch.
    ``cpu`` insists on the kernel (an error if it cannot be built)."""
    on_cuda = device is not None and str(device).startswith("cuda")
    if name == "torch":
        return TorchBackend()
    if name == "cpu" or (name == "auto" and not on_cuda):
        lib = paged_decode.load()
        if lib is not None:
            return CpuBackend(lib)
        if name == "cpu":
            raise RuntimeError(
                "attention backend 'cpu' needs the compiled kernel, which did not build (see the log; "
                "VLMSERVE_CPU_KERNELS=0 disables it)"
            )
        return TorchBackend()
    from lm_engine.attention.triton_backend import TritonBackend

    return TritonBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "CpuBackend", "TorchBackend", "get_backend"]
