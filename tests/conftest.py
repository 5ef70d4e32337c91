from __future__ import annotations

from pathlib import Path

import pytest

# ---------------------------------------------------------------- generated checkpoints


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` Qwen2-VL test checkpoint (seed 0), built once per test session."""
    from lm_engine.models.qwen2_vl_make import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), preset="tiny", seed=0)
