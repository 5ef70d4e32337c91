"""Process-wide settings that keep a long-running server's native memory bounded; applied at start-up.

On the CPU, bfloat16/float16 matmuls run through oneDNN, which PyTorch (ideep) and oneDNN itself cache per
distinct shape: a compiled primitive and its buffers for every new token count or image size, up to 1,024
entries each by default. A server sees a new shape with nearly every request (ragged prefill chunks, images
of any size), so those caches grew by ~0.2 MB per request for thousands of requests
(benchmarks/soak.py, the small preset in bfloat16: +225 MB per 1,000 requests with the defaults, +2 MB
with 16 entries, and no slower). A few entries keep what a steady decode batch reuses.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("vlmserve.memory")

NATIVE_CACHE_ENTRIES = 16
# ideep's per-shape primitive cache (PyTorch's oneDNN glue) and oneDNN's own.
_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_native_caches(entries: int = NATIVE_CACHE_ENTRIES) -> dict[str, str]:
    """Cap the per-shape oneDNN caches at ``entries`` unless the environment already sets them; returns the
    values in force. NOTE: both are read once, at the first oneDNN primitive: call this before any half-
    precision matmul (before the engine is built)."""
    for name in _CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    applied = {name: os.environ[name] for name in _CACHE_VARIABLES}
    log.info("oneDNN shape caches: %s", ", ".join(f"{k}={v}" for k, v in applied.items()))
    return applied


# Pixel-patch and embedding buffers over this size get mappings of their own, returned to the system when
# freed. NOTE: glibc's default raises the threshold to the largest block freed so far (up to 32 MB), after
# which every image's buffers come from the heap and stay there: the pool's process grew 313 -> 1,002 MB over
# 2,000 distinct images with the default and oscillated between 380 and 820 MB with 128 KB
# (benchmarks/soak.py through --encoder-workers 1; benchmarks/README.md).
MMAP_THRESHOLD = 128 * 1024


def return_freed_buffers(threshold: int = MMAP_THRESHOLD) -> None:
    """Fix glibc's mmap threshold in this process (mallopt) and, through the environment, in the worker
    processes it starts, unless the environment already sets it."""
    import ctypes
    import ctypes.util

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(threshold))
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "mallopt"):  # glibc only; other allocators keep their own policy
        m_mmap_threshold = -3
        libc.mallopt(m_mmap_threshold, int(os.environ["MALLOC_MMAP_THRESHOLD_"]))
