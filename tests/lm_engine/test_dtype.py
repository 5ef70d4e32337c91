"""dtype="auto": the checkpoint's own dtype, except half precision on a CPU that runs it slower than float32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lm_engine.config as config_mod
from lm_engine import LLM, SamplingParams
from lm_engine.config import EngineConfig, cpu_matmul_is_fast
from tests.support import HFOracle, image_part, make_image, user


def test_resolve_rules(monkeypatch):
    monkeypatch.setattr(config_mod, "cpu_matmul_is_fast", lambda dtype: False)
    assert EngineConfig("m").resolve_dtype(torch.bfloat16) == torch.float32
    assert EngineConfig("m").resolve_dtype(torch.float16) == torch.float32
    assert EngineConfig("m").resolve_dtype(torch.float32) == torch.float32
    # An explicit dtype is obeyed; a GPU keeps the checkpoint's dtype.
    assert EngineConfig("m", dtype="bfloat16").resolve_dtype(torch.float32) == torch.bfloat16
    assert EngineConfig("m", device="cuda").resolve_dtype(torch.bfloat16) == torch.bfloat16
    # A float32 checkpoint computes in bfloat16 on CUDA unless float32 is asked for.
    assert EngineConfig("m", device="cuda:1").resolve_dtype(torch.float32) == torch.bfloat16
    assert EngineConfig("m", device="cuda", dtype="float32").resolve_dtype(torch.float32) == torch.float32
    monkeypatch.setattr(config_mod, "cpu_matmul_is_fast", lambda dtype: True)
    assert EngineConfig("m").resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        EngineConfig("m", dtype="int3").resolve_dtype(torch.float32)


def test_probe_agrees_with_a_longer_timing():
    """The 10 ms probe's verdict matches a timing 20× longer (a flaky probe would flip a server's dtype)."""
    import time

    def rate(dt: torch.dtype) -> float:
        a, b = torch.randn(128, 1024).to(dt), torch.randn(1024, 1024).to(dt)
        a @ b
        t0 = time.perf_counter()
        for _ in range(3):
            a @ b
        return time.perf_counter() - t0

    slow, fast = rate(torch.bfloat16), rate(torch.float32)
    if 0.7 < slow / fast < 1.5:
        pytest.skip(f"bf16 and fp32 within 50 % here ({slow / fast:.2f}×): either verdict is right")
    assert cpu_matmul_is_fast(torch.bfloat16) == (slow <= fast)


@pytest.fixture(scope="module")
def bf16_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint stored in bfloat16, as real Qwen2-VL checkpoints are."""
    out = tmp_path_factory.mktemp("tiny_bf16")
    for f in tiny_ckpt.iterdir():
        shutil.copy(f, out / f.name)
    tensors = load_file(tiny_ckpt / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_bf16_checkpoint_on_a_slow_cpu_computes_in_float32(bf16_ckpt, monkeypatch):
    monkeypatch.setattr(config_mod, "cpu_matmul_is_fast", lambda dtype: False)
    llm = LLM(str(bf16_ckpt), num_kv_blocks=64)
    try:
        runner = llm.engine.runner
        assert llm.engine.dtype == torch.float32
        assert runner.kv_cache.dtype == torch.float32
        assert {p.dtype for p in runner.model.parameters()} == {torch.float32}
        assert {p.dtype for p in runner.vision.parameters()} == {torch.float32}
        convs = [user("describe", image_part(make_image(84, 56, seed=3))), user("count to five")]
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=12))
        # transformers on the same bf16 checkpoint, upcast to float32: token for token.
        oracle = HFOracle(bf16_ckpt)
        for conv, out in zip(convs, outs):
            assert list(out.token_ids) == oracle.generate(conv, 12)
    finally:
        llm.close()
