from __future__ import annotations

from pathlib import Path

import pytest

# ---------------------------------------------------------------- generated checkpoints


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` Qwen2-VL test checkpoint (seed 0), built once per test session."""
    from lm_engine.models.qwen2_vl_make import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` Qwen3-VL test checkpoint (seed 0), written through `vlmserve make-model`."""
    from api.cli import main

    out = tmp_path_factory.mktemp("qwen3_tiny_ckpt")
    assert main(["make-model", "--family", "qwen3_vl", "--preset", "tiny", "--out", str(out)]) == 0
    return out


# ---------------------------------------------------------------- the real Redis (engine-level tests)

ENGINE_REDIS_URL = "redis://127.0.0.1:6379/14"  # NOTE: loopback only; db 14 is the engine tests' own


@pytest.fixture
def redis_db_url():
    """Redis for engine tests: skips locally without a server, fails on CI; deletes test keys after."""
    import os

    import redis

    client = redis.Redis.from_url(ENGINE_REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        if os.environ.get("CI"):
            pytest.fail(f"Redis on 127.0.0.1:6379 did not answer ({exc!r}); CI must run the Redis tests")
        pytest.skip(f"Redis on 127.0.0.1:6379 did not answer ({exc!r})")
    yield ENGINE_REDIS_URL
    for key in client.scan_iter(match="vlmserve-test-*", count=500):
        client.delete(key)
    client.close()
