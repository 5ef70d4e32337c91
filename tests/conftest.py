from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import HFOracle, redis_client

# ---------------------------------------------------------------- generated checkpoints and the oracle


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` Qwen2-VL test checkpoint (seed 0), built once per test session."""
    from lm_engine.models.qwen2_vl_make import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def hf_oracle(tiny_ckpt: Path) -> HFOracle:
    """transformers' generate() on the tiny checkpoint, built once per session (its answers memoised)."""
    return HFOracle(tiny_ckpt)


# ---------------------------------------------------------------- the real Redis (engine-level tests)

ENGINE_REDIS_URL = "redis://127.0.0.1:6379/14"  # NOTE: loopback only; db 14 is the engine tests' own


@pytest.fixture
def redis_db_url():
    """Redis for engine tests: skips locally without a server, fails on CI; deletes test keys after."""
    client = redis_client(ENGINE_REDIS_URL)
    yield ENGINE_REDIS_URL
    for key in client.scan_iter(match="vlmserve-test-*", count=500):
        client.delete(key)
    client.close()
