"""Results of the start-up timing probes (which matmul dtype, attention kernel or linear layout is faster on this
machine), kept across processes so that a server starts without timing anything it timed before.

Not the image-header probe (probe.py): these are the ``best_times`` measurements that pick a fast path. A result
is stored in ``$VLMSERVE_CACHE_DIR/probes.json`` (default ``~/.cache/vlmserve``) under a key of this machine's
identity (CPU model name and flags from /proc/cpuinfo, torch's version, :data:`PROBE_VERSION`) and the probe's
name and arguments, so a cache copied to another CPU or kept across a torch upgrade is never read as its own.
``VLMSERVE_REMEASURE_PROBES=1`` (``vlmserve serve --remeasure-probes``) measures again and overwrites. The file is
a convenience: unreadable, corrupt or not writable, it is ignored (and rewritten where it can be), and start-up
goes on measuring.

It lives in preprocess, beside ``best_times`` and the kernel cache, so that a worker process uses it without
importing the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("vlmserve.probes")

# NOTE: bump when a probe's method changes (its shapes, its rounds, how a verdict is drawn), so results measured
# the old way are measured again.
PROBE_VERSION = 1
REMEASURE_VARIABLE = "VLMSERVE_REMEASURE_PROBES"
_FILE = "probes.json"

_lock = threading.Lock()
_measured_s = 0.0  # seconds spent measuring in this process (start-up phases report it as "probes")


def cache_path() -> Path:
    root = os.environ.get("VLMSERVE_CACHE_DIR") or "~/.cache/vlmserve"
    return Path(root).expanduser() / _FILE


def machine_identity() -> dict[str, str]:
    """What a measurement depends on besides the probe itself: the CPU (model name and feature flags) and the
    library doing the arithmetic."""
    import torch

    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        import platform

        model = platform.processor()
    return {
        "cpu_model": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),  # a kernel that wins on 2 threads may lose on 16
        "probe_version": str(PROBE_VERSION),
    }


def library_tag(lib) -> str:
    """A compiled library's file name, which names its build (source, flags, compiler, CPU: runtime/native.py),
    so a rebuilt kernel is timed again; "" for none."""
    return os.path.basename(getattr(lib, "_name", "") or "") if lib is not None else ""


def remeasure_requested() -> bool:
    return os.environ.get(REMEASURE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def measured_seconds() -> float:
    """Seconds this process has spent measuring probes so far (cache hits cost nothing here)."""
    return _measured_s


def cached_probe(
    name: str,
    args: dict[str, Any],
    measure: Callable[[], Any],
    *,
    identity: dict[str, str] | None = None,
    remeasure: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Any:
    """``measure()``'s result for probe ``name`` with ``args`` on this machine: read from the cache file where it
    holds one for this machine's identity, else measured and stored. The result must survive JSON (a bool, a
    number, a string). ``identity`` and ``remeasure`` default to :func:`machine_identity` and the environment."""
    global _measured_s
    key = _key(identity or machine_identity(), name, args)
    if not (remeasure_requested() if remeasure is None else remeasure):
        entry = _read().get(key)
        if isinstance(entry, dict) and "value" in entry:
            return entry["value"]
    start = clock()
    value = measure()
    spent = clock() - start
    with _lock:
        _measured_s += spent
        entries = _read()
        entries[key] = {"name": name, "args": args, "value": value, "seconds": round(spent, 4)}
        _write(entries)
    return value


def _key(identity: dict[str, str], name: str, args: dict[str, Any]) -> str:
    text = json.dumps([identity, name, args], sort_keys=True, default=str)
    return f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _read() -> dict[str, Any]:
    try:
        entries = json.loads(cache_path().read_text())
    except (OSError, ValueError):  # missing, unreadable, corrupt: as if empty
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(entries: dict[str, Any]) -> None:
    """Replace the file whole (a private temporary file, then a rename), so a reader never sees half of one.
    NOTE: two processes writing at once may each drop the other's new entry; it is measured again next time."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probes-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("could not write the probe cache %s: %s (start-up measures again next time)", path, exc)
