"""The embedded demo model: a trained checkpoint shipped in the repository, so a fresh machine needs no
download and no training.

``tools/demo_checkpoint/`` holds what ``vlmserve train-demo`` wrote (bf16 safetensors, the tokenizer,
chat template and processor config); it answers the synthetic task set's five questions
(``tools/demo_tasks.py``). ``VLMSERVE_DEMO_PRESET=tiny|small|...`` asks for a random-weight preset
instead, generated once into a cache directory (for load tests that want a bigger or smaller model).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "demo_checkpoint"
DEMO_SEED = 0
# Bump when the generator's output changes, so stale caches are rebuilt rather than trusted.
DEMO_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("VLMSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vlmserve"
    )
    return Path(root)


def demo_checkpoint(preset: str | None = None) -> Path:
    """The shipped demo checkpoint; with ``preset`` (or ``VLMSERVE_DEMO_PRESET``) a random-weight checkpoint
    of that preset, generated on first use (safe against concurrent first uses)."""
    preset = preset or os.environ.get("VLMSERVE_DEMO_PRESET")
    if not preset:
        if not (SHIPPED / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"the shipped demo checkpoint is missing ({SHIPPED}/model.safetensors): restore it from git, "
                "or set VLMSERVE_DEMO_PRESET=small for random weights"
            )
        return SHIPPED
    return random_checkpoint(preset)


def random_checkpoint(preset: str) -> Path:
    from tools.qwen2_vl_make import make_checkpoint

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
