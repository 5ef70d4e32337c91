"""The decoder's norms, rotary and silu · up on the compiled library (lm_engine.models.qwen2_vl.use_step_kernels):
the same formulas as the decoder's torch ops; a decode step's inputs on the caller alone, a prefill chunk's on all
threads of the library's prefill pool."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from lm_engine import LLM, SamplingParams
from lm_engine.models import qwen2_vl
from lm_engine.models.qwen2_vl import MLP, STEP_KERNEL_ELEMS, RMSNorm
from runtime import cpu_kernel
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
def test_prefill_sized_inputs_take_the_kernels_on_the_prefill_pool(monkeypatch):
    """Past STEP_KERNEL_ELEMS the norm and silu · up run on torch's thread count on the prefill pool, with the same
    formulas; float32 keeps torch's ops."""
    calls = []
    for name in ("rms_norm", "silu_mul_halves"):
        real = getattr(cpu_kernel, name)
        monkeypatch.setattr(
            cpu_kernel,
            name,
            lambda *a, _real=real, _name=name, **k: calls.append((_name, k)) or _real(*a, **k),
        )
    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(256, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen))
    assert norm.take_lib(LIB)
    rows = STEP_KERNEL_ELEMS // 256 + 1  # a prefill chunk
    x = (torch.randn(rows, 256, generator=gen) * 3).to(torch.bfloat16)
    with torch.no_grad():
        got, want = norm(x), torch_norm(norm, x)
    assert (got != want).float().mean() < 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)
    assert not RMSNorm(256, 1e-6).take_lib(LIB)  # float32: torch's ops, to the bit as before
    cfg = qwen2_vl.Qwen2VLConfig.__new__(qwen2_vl.Qwen2VLConfig)
    cfg.hidden_size, cfg.intermediate_size = 64, STEP_KERNEL_ELEMS // 2
    mlp = MLP(cfg).to(torch.bfloat16)
    assert mlp.take_lib(LIB)
    h = torch.randn(2, 64, generator=gen).to(torch.bfloat16)  # 2 rows × 32,768 · 2: past the bound
    with torch.no_grad():
        got = mlp(h)
        gate, up = mlp.gate_up_proj(h).chunk(2, dim=-1)
        want = mlp.down_proj(F.silu(gate) * up)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    prefill = {"threads": torch.get_num_threads(), "pool": "prefill"}
    assert calls == [("rms_norm", prefill), ("silu_mul_halves", prefill)]


@needs_lib
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_silu_mul_halves_reads_a_fused_projection_in_place(rows):
    """The halves of [rows, 2·I] read where they lie equal silu_mul of their copies, to the bit, on one thread or
    both pools' threads; an odd width is refused."""
    gen = torch.Generator().manual_seed(rows)
    inter = 8960 + 8  # a tail past the vector lanes too
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    want = cpu_kernel.silu_mul(LIB, gate.contiguous(), up.contiguous(), threads=1)
    for threads, pool in ((1, "vision"), (2, "prefill"), (2, "vision")):
        got = cpu_kernel.silu_mul_halves(LIB, gate_up, threads=threads, pool=pool)
        assert got.shape == (rows, inter) and torch.equal(got, want), (threads, pool)
    assert (want != F.silu(gate) * up).float().mean() < 1e-3
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernel.silu_mul_halves(LIB, gate_up[:, :-1])


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
            mods = [
                m
                for m in llm.engine.runner.model.modules()
                if isinstance(m, (RMSNorm, MLP, qwen2_vl.Attention))
            ]
            assert mods and all((m.lib is not None) == expect for m in mods), dtype
            outs = llm.chat(convs, params)
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor of heads [T, H, D] in its dtype: the oracle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)


def step_inputs(rows: int, heads: int, width: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, width, generator=gen) * 4).to(torch.bfloat16)
    angles = torch.randn(rows, d // 2, generator=gen) * 50  # positions far out: cos and sin of every sign
    angles = torch.cat([angles, angles], dim=-1)
    return qkv, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


@needs_lib
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_rope_heads_is_torchs_rotary_to_the_bit(rows, d):
    heads, v_heads = 6, 2
    qkv, cos, sin = step_inputs(rows, heads, (heads + v_heads) * d, d, seed=rows * d)
    want = torch_rotary(qkv[:, : heads * d].view(rows, heads, d), cos, sin)
    before = qkv.clone()
    cpu_kernel.rope_heads(LIB, qkv, heads, d, cos, sin)
    assert torch.equal(qkv[:, : heads * d].view(rows, heads, d), want)
    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])  # v untouched
    spread = before.clone()  # a prefill chunk's call: the pool's threads, the same bits
    cpu_kernel.rope_heads(LIB, spread, heads, d, cos, sin, threads=2, pool="prefill")
    assert torch.equal(spread, qkv)


@needs_lib
@pytest.mark.parametrize("rows", [1, 4])
def test_rope_heads_with_norms_is_qwen3s_q_k_norm_then_rotary(rows):
    d, q_heads, k_heads = 128, 16, 8
    qkv, cos, sin = step_inputs(rows, q_heads + k_heads, (q_heads + 2 * k_heads) * d, d, seed=7 + rows)
    gen = torch.Generator().manual_seed(11)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(torch.bfloat16), RMSNorm(d, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(d, generator=gen) * 2)
        k_norm.weight.copy_(torch.rand(d, generator=gen) * 2)
        q = torch_norm(q_norm, qkv[:, : q_heads * d].view(rows, q_heads, d))
        k = torch_norm(k_norm, qkv[:, q_heads * d : (q_heads + k_heads) * d].view(rows, k_heads, d))
    want = torch.cat([torch_rotary(q, cos, sin), torch_rotary(k, cos, sin)], dim=1)
    norms = (q_heads, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
    cpu_kernel.rope_heads(LIB, qkv, q_heads + k_heads, d, cos, sin, norms)
    got = qkv[:, : (q_heads + k_heads) * d].view(rows, q_heads + k_heads, d)
    # the norm's sum of squares is added in another order (as the norm kernel's): rare one-step differences
    assert (got != want).float().mean() < 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


@needs_lib
def test_rope_heads_refuses_what_it_cannot_rotate():
    qkv, cos, sin = step_inputs(2, 2, 256, 128, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernel.rope_heads(LIB, qkv, 3, 128, cos, sin)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernel.rope_heads(LIB, qkv.float(), 2, 128, cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        cpu_kernel.rope_heads(LIB, qkv, 2, 128, cos[:1], sin[:1])
    with pytest.raises(RuntimeError, match="code -3"):  # an odd head size: no halves to swap
        cpu_kernel.rope_heads(LIB, qkv[:, :255], 3, 85, cos[:, :85], sin[:, :85])


@needs_lib
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_decoder_attention_takes_the_rope_kernel_at_every_size(family, monkeypatch):
    """One attention layer, bf16: the kernel's output equals the torch path's, for a decode step on the caller
    alone and for a prefill-sized input on the prefill pool's threads."""
    from lm_engine.models import qwen3_vl

    if family == "qwen2":
        cfg = qwen2_vl.Qwen2VLConfig.__new__(qwen2_vl.Qwen2VLConfig)
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads = 256, 4, 2
        attn = qwen2_vl.Attention(cfg)
    else:
        cfg = qwen3_vl.Qwen3VLConfig.__new__(qwen3_vl.Qwen3VLConfig)
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 256, 4, 2, 64
        cfg.attention_bias, cfg.rms_norm_eps = False, 1e-6
        attn = qwen3_vl.Attention(cfg)
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    attn = attn.to(torch.bfloat16)
    seen = []

    class Backend:
        def forward(self, q, k, v, k_cache, v_cache, meta, scale):
            seen.append((q.clone(), k.clone(), v.clone()))
            return q.reshape(q.shape[0], -1).clone()

    calls = []
    real = cpu_kernel.rope_heads
    monkeypatch.setattr(cpu_kernel, "rope_heads", lambda *a, **k: calls.append(k) or real(*a, **k))
    d = attn.head_dim
    prefill = {"threads": torch.get_num_threads(), "pool": "prefill"}
    for rows, kernel in ((3, {"threads": 1}), (STEP_KERNEL_ELEMS // 512 + 1, prefill)):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        angles = torch.randn(rows, d // 2) * 20
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
        seen.clear(), calls.clear()
        attn.lib = None
        with torch.no_grad():
            attn(x, cos, sin, None, None, None, Backend())
        assert not calls
        assert attn.take_lib(LIB)
        with torch.no_grad():
            attn(x, cos, sin, None, None, None, Backend())
        assert calls == [kernel]
        (q0, k0, v0), (q1, k1, v1) = seen
        assert torch.equal(v0, v1)
        if family == "qwen2":
            assert torch.equal(q0, q1) and torch.equal(k0, k1)
        else:
            assert (q0 != q1).float().mean() < 2e-3 and (k0 != k1).float().mean() < 2e-3
            torch.testing.assert_close(q1.float(), q0.float(), atol=1e-2, rtol=1.6e-2)
