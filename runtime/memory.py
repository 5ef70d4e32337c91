"""Process-wide settings that keep a long-running process's native memory bounded and its large buffers cheap,
applied at start-up (oneDNN's per-shape caches, glibc's mmap threshold, huge pages for large tensors, jemalloc
for training), and the memory readings the rest of the
project sizes itself by (resident memory, what the kernel says is available, byte counts as flags write them).

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
import resource

log = logging.getLogger("vlmserve.memory")

GiB = 1 << 30
MiB = 1 << 20


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


# torch's CPU allocator aligns a buffer of 2 MB or more to 2 MB and asks the kernel for transparent huge pages on
# it where this is set (c10's THP_MEM_ALLOC_ENABLE, read at its first such buffer). NOTE: a prefill chunk or a
# tower pass allocates GBs of short-lived activations, each a fresh mapping under the 128 KB mmap threshold below,
# and each 4 KB page of it faulted in and zeroed: 784k page faults per 1024² image through the Qwen2-VL-2B tower,
# 8.70 s; with huge pages 43k faults and 7.98 s, as fast as keeping every buffer on the heap (7.97 s, 2k faults)
# while freed buffers still go back to the system (2-vCPU Xeon with AMX, bf16, 2026-12-07, one process each,
# best of 3). Only where the system's THP mode is `madvise` or `always`.
HUGE_PAGE_VARIABLE = "THP_MEM_ALLOC_ENABLE"


def huge_page_tensors() -> str:
    """Large torch buffers on transparent huge pages unless the environment already decides (set
    ``THP_MEM_ALLOC_ENABLE=0`` to keep 4 KB pages); returns the value in force. Call it before the first large
    tensor (before the engine or a tower is built); worker processes started afterwards inherit it."""
    value = os.environ.setdefault(HUGE_PAGE_VARIABLE, "1")
    log.info("large tensors on transparent huge pages: %s=%s", HUGE_PAGE_VARIABLE, value)
    return value


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
    arithmetic). The server keeps glibc: there jemalloc measured no better (docs/memory.md)."""
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
