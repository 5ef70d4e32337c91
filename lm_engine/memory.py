"""How much memory the engine may take: the KV pool's budget, the fit check before any weight is read, the
pool itself (the process-wide native memory settings are :mod:`runtime.memory`'s)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from runtime.memory import MiB, format_bytes

log = logging.getLogger("vlmserve.memory")

# -- how much memory the engine may take ----------------------------------------------------------------------


# NOTE: what the serving process comes to hold after the engine starts, besides the weights, the KV pool and the
# warm-up's activations: the tokenizer, a step's inputs and logits, oneDNN's capped per-shape caches, the encoded
# images of live requests, the allocator's slack. The demo server grew by ~170 MB past its imports (whose 0.75 GB,
# torch's CUDA libraries included, are resident before the engine starts and so are not in the figure it starts
# from).
RUNTIME_RESERVE = 256 * MiB
# A preprocess worker process (Python, Pillow, numpy: ~45 MB measured) with a large image's decode and patch buffers.
PREPROCESS_WORKER_BYTES = 128 * MiB
# An encoder worker process's own runtime (torch imported, anonymous memory), besides its copy of the tower.
ENCODER_WORKER_BYTES = 384 * MiB


_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


@dataclass(slots=True, frozen=True)
class WeightBytes:
    """What a checkpoint's tensors take in memory once loaded: all of them, and the vision tower's share."""

    total: int
    tower: int


def checkpoint_weight_bytes(path: str | Path, itemsize: int) -> WeightBytes:
    """The checkpoint's tensors in the compute dtype (``itemsize`` bytes per floating-point element; integer tensors
    keep theirs), read from the safetensors headers alone: a few kilobytes per shard, no tensor is read."""
    from runtime.weights import checkpoint_shards

    total = tower = 0
    for shard, names in checkpoint_shards(path).items():
        wanted = None if names is None else set(names)
        for name, info in _safetensors_header(shard).items():
            if name == "__metadata__" or (wanted is not None and name not in wanted):
                continue
            dtype = info["dtype"]
            size = itemsize if dtype.startswith(("F", "BF")) else _SAFETENSORS_ITEMSIZE[dtype]
            n = size * math.prod(info["shape"])
            total += n
            if name.startswith("visual.") or ".visual." in name:
                tower += n
    return WeightBytes(total, tower)


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    """One token's keys and values across the decoder's layers (``cfg``: a decoder config)."""
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize


@dataclass(slots=True, frozen=True)
class MemoryPlan:
    """What a CPU engine's KV pool is sized from (see :func:`kv_budget_bytes`)."""

    available: int  # MemAvailable when the engine started, before any weight was read
    weight_bytes: int  # the checkpoint's tensors in the compute dtype
    reserve: int  # what the server holds besides weights, KV pool and warm-up (runtime_reserve_bytes)


def kv_budget_bytes(
    available_at_start: int,
    weight_bytes: int,
    warmup_peak: int,
    utilization: float,
    reserve: int,
    fixed: int | None = None,
) -> int:
    """Bytes for the KV pool: ``fixed`` where given (``--kv-cache-memory``), else ``utilization`` of the memory
    that was available when the engine started, before any weight was loaded, less what the weights, the
    worst-case step's activations and the process's other holdings (``reserve``) take. As vLLM sizes its pool
    from ``gpu_memory_utilization``: the share is of the whole, and what the rest of the server needs comes out
    of it. Negative where nothing is left."""
    if fixed is not None:
        return int(fixed)
    return int(available_at_start * utilization) - weight_bytes - warmup_peak - reserve


def runtime_reserve_bytes(
    embedding_cache_bytes: int, preprocess_workers: int, encoder_workers: int, tower_bytes: int
) -> int:
    """What the server holds besides the weights, the KV pool and the warm-up, its helper processes included: the
    in-process embedding cache fills to its cap; each preprocess worker takes its own; each encoder worker
    (``--encoder-workers``) loads the vision tower once more, while the engine keeps its own copy to fall back on."""
    return (
        RUNTIME_RESERVE
        + embedding_cache_bytes
        + preprocess_workers * PREPROCESS_WORKER_BYTES
        + encoder_workers * (ENCODER_WORKER_BYTES + tower_bytes)
    )


class NotEnoughMemory(RuntimeError):
    """The model, its smallest useful KV pool and the server's own needs do not fit this machine's memory; the
    message is one line that says what it needs, what there is and which flag to change."""


def check_fit(
    *,
    available: int,
    weight_bytes: int,
    reserve: int,
    kv_bytes_per_token: int,
    max_model_len: int,
    min_kv_bytes: int,
    utilization: float,
    fixed_kv: int | None = None,
    fixed_flag: str = "--kv-cache-memory",
) -> None:
    """Raise :class:`NotEnoughMemory` where the engine cannot start: before any weight is read, from the
    checkpoint's headers. Without a fixed pool the smallest one that serves (one ``max_model_len`` sequence,
    ``min_kv_bytes``) must fit the ``utilization`` share; a fixed pool (``fixed_kv`` bytes, from ``fixed_flag``)
    must fit what is available."""
    w, r = format_bytes(weight_bytes), format_bytes(reserve)
    if fixed_kv is not None:
        need = weight_bytes + fixed_kv + reserve
        if need <= available:
            return
        room = available - weight_bytes - reserve
        fix = (
            f"lower {fixed_flag} to {format_bytes(room)} or less"
            if room >= min_kv_bytes
            else "the weights leave no room for a KV pool; use a smaller checkpoint or free memory"
        )
        raise NotEnoughMemory(
            f"not enough memory: {format_bytes(need)} needed (weights {w} + KV cache {format_bytes(fixed_kv)} "
            f"from {fixed_flag} + runtime {r}), {format_bytes(available)} available; {fix}"
        )
    share = int(available * utilization)
    need = weight_bytes + min_kv_bytes + reserve
    if need <= share:
        return
    fixes = []
    room = share - weight_bytes - reserve
    if room > 0 and room // kv_bytes_per_token >= 1:
        fixes.append(f"lower --max-model-len to {room // kv_bytes_per_token} or less")
    if need <= available:
        fixes.append(f"raise --memory-utilization to {math.ceil(need / available * 100) / 100:.2f}")
        fixes.append(
            f"or give --kv-cache-memory of at most {format_bytes(available - weight_bytes - reserve)}"
        )
    if not fixes:
        fixes.append(
            "the weights and the runtime alone take more than is available: free memory, use a smaller "
            "checkpoint, or lower --embedding-cache-mb"
        )
    raise NotEnoughMemory(
        f"not enough memory: {format_bytes(need)} needed (weights {w} + KV cache for one {max_model_len}-token "
        f"sequence {format_bytes(min_kv_bytes)} + runtime {r}), {format_bytes(share)} allowed "
        f"(--memory-utilization {utilization:g} of {format_bytes(available)} available); {', '.join(fixes)}"
    )


def zeroed_pool(shape: tuple[int, ...], dtype, device):
    """A zero-filled tensor for the KV pool. On a CPU it lies in an anonymous mapping of its own: the kernel
    hands out its pages already zeroed when they are first touched, so start-up does not write every byte of
    a pool of many GiB (``torch.zeros`` spent 6.6 s on a 14 GiB pool at the 2B shape, most of the start-up),
    and transparent huge pages are asked for where the kernel grants them on request.

    NOTE: the pool's memory is still counted when it is sized (see :func:`kv_budget_bytes`); only the page
    faults move from start-up to the first steps that reach each page."""
    import mmap

    import torch

    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # a kernel without transparent huge pages refuses: 4 KiB pages, still zeroed on first touch
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    # NOTE: the tensor keeps the mapping alive (frombuffer holds a reference to the buffer it wraps).
    return torch.frombuffer(mapping, dtype=dtype).view(shape)
