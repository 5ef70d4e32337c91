"""Attention backends: torch (CPU, reference) and Triton (CUDA)."""

from __future__ import annotations

from lm_engine.attention.base import AttentionBackend, AttentionMetadata
from lm_engine.attention.torch_backend import TorchBackend


def get_backend(device: str | None = None, name: str = "auto") -> AttentionBackend:
    """``auto`` picks Triton on CUDA when it imports, torch otherwise."""
    if name == "torch" or (name == "auto" and (device is None or not str(device).startswith("cuda"))):
        return TorchBackend()
    from lm_engine.attention.triton_backend import TritonBackend

    return TritonBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchBackend", "get_backend"]
