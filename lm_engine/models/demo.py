"""The embedded demo checkpoint: generated once into a cache directory, so a fresh machine needs no download."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

DEMO_PRESET = os.environ.get("VLMSERVE_DEMO_PRESET", "small")
DEMO_SEED = 0
# Bump when the generator's output changes, so stale caches are rebuilt rather than trusted.
DEMO_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("VLMSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlmserve"
    )
    return Path(root)


def demo_checkpoint(preset: str | None = None) -> Path:
    """Path of the demo checkpoint, generating it on first use (safe against concurrent first uses)."""
    from lm_engine.models.qwen2_vl_make import make_checkpoint

    preset = preset or DEMO_PRESET
    target = cache_dir() / f"demo-qwen2-vl-{preset}-s{DEMO_SEED}-v{DEMO_VERSION}"
    done = target / ".complete"
    if done.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return target
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_checkpoint(tmp, preset=preset, seed=DEMO_SEED)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target
