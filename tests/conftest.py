from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support import EOS_PROBE, HFOracle, redis_client


def pytest_configure(config: pytest.Config) -> None:
    """Start-up probe results go to a directory of this run's own (runtime/timing_cache.py): a test never reads
    what an earlier run or the user's ~/.cache measured, and servers started in subprocesses inherit it."""
    import os
    import tempfile

    os.environ["VLMSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="vlmserve-test-cache-")


# ---------------------------------------------------------------- generated checkpoints and the oracle


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` Qwen2-VL test checkpoint (seed 0), built once per test session."""
    from tools.qwen2_vl_make import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def hf_oracle(tiny_ckpt: Path) -> HFOracle:
    """transformers' generate() on the tiny checkpoint, built once per session (its answers memoised)."""
    return HFOracle(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny25_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` Qwen2.5-VL test checkpoint (seed 0): window attention (8-patch windows), one full-attention
    block, RMSNorm and the gated MLP in the tower; built once per test session."""
    from tools.qwen2_vl_make import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny25_ckpt"), preset="tiny", seed=0, family="qwen2_5_vl")


@pytest.fixture(scope="session")
def hf_oracle25(tiny25_ckpt: Path) -> HFOracle:
    """transformers' generate() on the tiny Qwen2.5-VL checkpoint (its own Qwen2_5_VL modeling code)."""
    oracle = HFOracle(tiny25_ckpt)
    assert type(oracle.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    return oracle


@pytest.fixture(scope="session")
def eos_ckpt(tiny_ckpt: Path, hf_oracle: HFOracle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint (same weights) whose EOS is a token that its greedy answer to EOS_PROBE produces
    early: the tiny model never emits its own EOS greedily, so without this no test sees a choice end by EOS."""
    ids = hf_oracle.generate(EOS_PROBE, 24)
    eos = next(tok for j, tok in enumerate(ids) if j >= 3 and tok not in ids[:j])
    out = tmp_path_factory.mktemp("eos_ckpt")
    shutil.copytree(tiny_ckpt, out, dirs_exist_ok=True)
    for name, value in (("config.json", eos), ("generation_config.json", [eos])):
        config = json.loads((out / name).read_text())
        config["eos_token_id"] = value
        (out / name).write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def eos_oracle(eos_ckpt: Path) -> HFOracle:
    """transformers' generate() on ``eos_ckpt``: it stops where the checkpoint's EOS says."""
    return HFOracle(eos_ckpt)


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
    client = redis_client(ENGINE_REDIS_URL)
    yield ENGINE_REDIS_URL
    for key in client.scan_iter(match="vlmserve-test-*", count=500):
        client.delete(key)
    client.close()
