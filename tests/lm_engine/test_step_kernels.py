"""A decode step's norms and silu · up on the compiled library (lm_engine.models.qwen2_vl.use_step_kernels): the
same formulas as the decoder's torch ops, taken only for decode-sized inputs, and run on the caller alone."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from encoder.attention import cpu_kernel
from lm_engine import LLM, SamplingParams
from lm_engine.models import qwen2_vl
from lm_engine.models.qwen2_vl import MLP, STEP_KERNEL_ELEMS, RMSNorm
from tests.support import user

LIB = cpu_kernel.load()
needs_lib = pytest.mark.skipif(LIB is None, reason="no compiler here: the decoder keeps torch's ops")


def torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2RMSNorm, written out: the oracle."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * xf.to(x.dtype)


@needs_lib
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_decode_norm_matches_transformers_formula(rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(1536, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(1536, generator=gen))
    assert norm.take_lib(LIB)
    calls = []
    real = cpu_kernel.rms_norm
    monkeypatch.setattr(cpu_kernel, "rms_norm", lambda *a, **k: calls.append(k) or real(*a, **k))
    x = (torch.randn(rows, 1536, generator=gen) * 3).to(torch.bfloat16)
    with torch.no_grad():
        got, want = norm(x), torch_norm(norm, x)
    assert calls == [{"threads": 1}]
    # equal but for rare one-step differences: the sum of squares is added in another order
    assert (got != want).float().mean() < 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)


@needs_lib
def test_large_inputs_and_other_dtypes_keep_torchs_ops(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "rms_norm", lambda *a, **k: pytest.fail("kernel taken"))
    monkeypatch.setattr(cpu_kernel, "silu_mul", lambda *a, **k: pytest.fail("kernel taken"))
    norm = RMSNorm(256, 1e-6).to(torch.bfloat16)
    assert norm.take_lib(LIB)
    rows = STEP_KERNEL_ELEMS // 256 + 1  # a prefill chunk
    x = torch.randn(rows, 256).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), torch_norm(norm, x))
    assert not RMSNorm(256, 1e-6).take_lib(LIB)  # float32: torch's ops, to the bit as before
    cfg = qwen2_vl.Qwen2VLConfig.__new__(qwen2_vl.Qwen2VLConfig)
    cfg.hidden_size, cfg.intermediate_size = 64, STEP_KERNEL_ELEMS // 2
    mlp = MLP(cfg).to(torch.bfloat16)
    assert mlp.take_lib(LIB)
    with torch.no_grad():
        mlp(torch.randn(2, 64).to(torch.bfloat16))  # 2 rows × 32,768: past the bound


@needs_lib
def test_decode_silu_mul_is_torchs_to_the_bit_but_rare_steps():
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(4, 8960, generator=gen) * 4).to(torch.bfloat16)
    up = torch.randn(4, 8960, generator=gen).to(torch.bfloat16)
    one = cpu_kernel.silu_mul(LIB, gate, up, threads=1)
    two = cpu_kernel.silu_mul(LIB, gate, up, threads=2)
    assert torch.equal(one, two)  # on the caller alone: the same arithmetic
    want = F.silu(gate) * up
    assert (one != want).float().mean() < 1e-3
    torch.testing.assert_close(one.float(), want.float(), atol=1e-2, rtol=8e-3)


@needs_lib
def test_engine_takes_the_step_kernels_in_bf16_only(tiny_ckpt):
    convs = [user("Count to ten, slowly and in words."), user("Name three colours.")]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for dtype, expect in (("bfloat16", True), ("float32", False)):
        with LLM(str(tiny_ckpt), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=64) as llm:
            mods = [m for m in llm.engine.runner.model.modules() if isinstance(m, (RMSNorm, MLP))]
            assert mods and all((m.lib is not None) == expect for m in mods), dtype
            outs = llm.chat(convs, params)
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
