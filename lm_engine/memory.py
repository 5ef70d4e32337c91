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
