"""C sources compiled with the system compiler on first use and loaded with ctypes.

Shared by preprocess (csrc/patchify.c) and the engine's CPU attention kernel
(runtime/csrc/paged_decode.c). It lives here, not in lm_engine, so a preprocess worker
loads its kernel without importing the engine. A build is cached under ``$VLMSERVE_KERNEL_CACHE``
(default ``~/.cache/vlmserve/kernels``), keyed by the source, the flags, the compiler and this CPU's
feature flags (the code is built for ``-march=native``), so a cache shared between machines never
hands a library to a CPU it was not built for. Without a compiler, or with ``VLMSERVE_CPU_KERNELS=0``,
:func:`load_library` returns ``None`` and callers keep their torch/numpy path. ctypes releases the
GIL for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("vlmserve.kernels")

_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def switched_off(variable: str) -> bool:
    """Whether an on-by-default environment switch is set to 0, false, no or off."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def best_times(
    calls: dict[str, Callable[[], object]], rounds: int = 3, timer: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Each call's best time, as the start-up probes that pick a fast path on this machine measure it: every
    call run once untimed (one-time set-up), then ``rounds`` times, the calls alternating in their order.
    Alternating puts a burst of load on every side; the best run is the one the scheduler left alone."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start = timer()
            call()
            best[name] = min(best[name], timer() - start)
    return best


def cache_dir() -> Path:
    return Path(os.environ.get("VLMSERVE_KERNEL_CACHE") or "~/.cache/vlmserve/kernels").expanduser()


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def source_bytes(source: Path) -> bytes:
    """The bytes a build of ``source`` depends on: the source and every local header it includes (``#include
    "..."``, searched as the compiler does, beside the including file), each once, in the order met."""
    seen: set[Path] = set()
    parts, todo = [], [source.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        text = path.read_bytes()
        parts.append(text)
        todo.extend((path.parent / name.decode()).resolve() for name in _LOCAL_INCLUDE.findall(text))
    return b"\0".join(parts)


def _build(cc: str, source: Path, march: str = "native", extra: tuple[str, ...] = ()) -> Path:
    if march == "native":
        # VLMSERVE_MARCH builds for another CPU than this one: benchmarks/as_avx2.sh measures an AVX2-only
        # machine's code paths (znver3) on a newer CPU.
        march = os.environ.get("VLMSERVE_MARCH", "").strip() or "native"
    flags = [f"-march={march}" if f == "-march=native" else f for f in _FLAGS] + list(extra)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(
            [source_bytes(source), " ".join(flags).encode(), version.encode(), _cpu_flags().encode()]
            + [platform.machine().encode()]
        )
    ).hexdigest()[:20]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name and rename: concurrent first uses (test workers, replicas) never load a
    # half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s with %s -> %s", source.name, cc, out)
    return out


def load_library(source: Path, march: str = "native", openmp: bool = False) -> ctypes.CDLL | None:
    """The library built from ``source``, or ``None`` (disabled, no compiler, or the build failed: logged).
    ``march``: the instruction set it is built for; tests pass an older one (``x86-64-v3``: AVX2 and FMA)
    to run the code paths of other CPUs than this one. ``openmp``: built with ``-fopenmp`` (the source's
    parallel calls then run on torch's own OpenMP threads), or without where the compiler cannot.

    Not cached here: each caller caches its own (and sets the argtypes) behind ``functools.cache``."""
    if switched_off("VLMSERVE_CPU_KERNELS"):
        return None
    cc = os.environ.get("CC", "cc").split()[0]
    if not shutil.which(cc):
        log.warning("no C compiler (%s): no %s kernel, using the slower fallback path", cc, source.stem)
        return None
    try:
        if openmp:
            try:
                return ctypes.CDLL(str(_build(cc, source, march, ("-fopenmp",))))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.info("%s without OpenMP (its own thread pool): %s", source.stem, exc)
        return ctypes.CDLL(str(_build(cc, source, march)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s kernel unavailable, using the slower fallback path: %s", source.stem, exc)
        return None
