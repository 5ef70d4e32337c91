"""Process-wide settings that keep a long-running server's native memory bounded, applied at start-up; and how
much memory the engine may take (the KV pool's budget, the fit check before any weight is read).

On the CPU, bfloat16/float16 matmuls run through oneDNN, which PyTorch (ideep) and oneDNN itself cache per
distinct shape: a compiled primitive and its buffers for every new token count or image size, up to 1,024
entries each by default. A server sees a new shape with nearly every request (ragged prefill chunks, images
of any size), so those caches grew by ~0.2 MB per request for thousands of requests
(benchmarks/soak.py, the small preset in bfloat16: +225 MB per 1,000 requests with the defaults, +2 MB
with 16 entries, and no slower). A few entries keep what a steady decode batch reuses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("vlmserve.memory")


def rss_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux's ru_maxrss counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


# Where Debian's libjemalloc2 and its kin put the library (x86-64, arm64, other layouts).
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)
# Keep freed pages mapped: with jemalloc's defaults a training step's large tensors (over its 8 MB oversize
# threshold) were handed back to the kernel as soon as they were freed and faulted in again on the next step
# (a quarter of the CPU time in the kernel, 13.5 images/s against glibc's 15.6).
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
_RELAUNCHED = "VLMSERVE_JEMALLOC_RELAUNCHED"


def installed_jemalloc(paths: tuple[str, ...] = JEMALLOC_PATHS) -> str | None:
    """The first of ``paths`` that exists, or None."""
    return next((p for p in paths if os.path.isfile(p)), None)


def jemalloc_relaunch(
    argv: list[str], environ: dict[str, str] | None = None, paths: tuple[str, ...] = JEMALLOC_PATHS
) -> tuple[list[str], dict[str, str]] | None:
    """The command line ``argv`` and the environment that run it again with jemalloc preloaded, or None where
    it should run as it is: jemalloc already relaunched it, ``VLMSERVE_ALLOCATOR=system`` asks for the C
    library's allocator, or no jemalloc is installed. ``MALLOC_CONF`` from the environment wins over
    ``JEMALLOC_CONF``.

    NOTE: for training, whose steps allocate and free tensors of many sizes: glibc's ``malloc`` took 10-14 %
    of ``train-demo``'s samples (``perf``, a 2-vCPU EPYC with AVX512-BF16), and the same 120 tower steps ran
    at 18.8 images/s under jemalloc against 16.3 (same weights to the byte: the allocator changes no
    arithmetic). The server keeps glibc: there jemalloc measured no better (README, memory)."""
    env = dict(os.environ if environ is None else environ)
    if env.get(_RELAUNCHED) or env.get("VLMSERVE_ALLOCATOR", "jemalloc") == "system":
        return None
    lib = installed_jemalloc(paths)
    if lib is None:
        return None
    preload = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    env[_RELAUNCHED] = "1"
    return list(argv), env


def allocator_in_use() -> str:
    """The allocator this process runs on: "jemalloc" where it has the library mapped, else "glibc"."""
    try:
        with open("/proc/self/maps") as f:
            return "jemalloc" if "libjemalloc" in f.read() else "glibc"
    except OSError:
        return "glibc"


def release_free_pages() -> bool:
    """Hand the pages jemalloc keeps for reuse back to the kernel now (every arena's dirty and muzzy pages);
    False where jemalloc is not the allocator. ``train-demo`` runs jemalloc keeping every page (fast steps)
    and calls this between steps now and then, so its resident memory stays bounded; it changes no
    arithmetic."""
    import ctypes

    if allocator_in_use() != "jemalloc":
        return False
    try:
        mallctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return False
    # MALLCTL_ARENAS_ALL is 4096: "arena.4096.purge" purges every arena
    return mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0)) == 0


# -- how much memory the engine may take ----------------------------------------------------------------------

GiB = 1 << 30
MiB = 1 << 20

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


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of the memory that can be taken without swapping (MemAvailable: free memory and the
    page cache it can reclaim), or None where there is no /proc."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_bytes(text: str | int) -> int:
    """A byte count as flags take it: ``4294967296``, ``4GiB``, ``512MiB``, ``4G`` / ``4GB`` (powers of 1000)."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "").removesuffix("b")
    binary = s.endswith("i")
    s = s.removesuffix("i")
    unit = s[-1] if s and s[-1] in "kmgt" else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MiB or a byte count)") from None
    scale = 1 << (10 * "_kmgt".index(unit)) if binary and unit else _UNITS[unit]
    if value < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return int(value * scale)


def format_bytes(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


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
    from encoder.models.weights import checkpoint_shards

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
