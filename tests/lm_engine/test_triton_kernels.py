"""Triton paged-KV kernels against the torch backend, run on the CPU by Triton's interpreter.

NOTE (measured on triton 3.8): ``TRITON_INTERPRET`` is consulted when a function is ``@triton.jit``-decorated,
and triton decorates its own helpers (``tl.zeros``, ``tl.max``, ``tl.sum``, ... in
``triton.language.standard``) when it is first imported. Setting the variable after that yields
interpreted kernels whose calls into those helpers fail ("Cannot call @triton.jit'd outside of the scope
of a kernel"), and setting it at this module's top would turn every later triton import of the session
into the interpreter. So unless the whole session already runs under the interpreter, one test reruns
this file in a fresh ``pytest`` process with ``TRITON_INTERPRET=1`` and the kernel tests skip here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lm_engine.attention.base import AttentionMetadata
from lm_engine.attention.torch_backend import TorchBackend, paged_decode, write_kv
from tests.support import prerequisite

try:
    import triton  # noqa: F401

    MISSING = None
except ImportError as exc:
    MISSING = f"triton is not importable ({exc}); bin/setup installs the [triton] extra"
_triton_installed = prerequisite(MISSING)


def _interpreter_ready() -> bool:
    """True when triton itself was imported under TRITON_INTERPRET=1 in this process."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


IN_PROCESS = _interpreter_ready()
interpreted = pytest.mark.skipif(not IN_PROCESS, reason="run in a TRITON_INTERPRET=1 subprocess")

# bf16 keeps 8 mantissa bits: one ulp at |x| in [1, 2) is 2^-7; the kernel rounds p to bf16 before P·V
# (as flash attention does) and both sides round the output, so allow about two ulps.
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernels_in_interpreter_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "not subprocess"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.fixture(scope="module")
def triton_mods():
    import lm_engine.attention.triton_backend as backend
    import lm_engine.attention.triton_kernels as kernels

    assert kernels._INTERPRETED
    return kernels, backend


def _tables(gen: torch.Generator, context_lens: list[int], block_size: int, spare: int = 3):
    """Disjoint, shuffled block lists per sequence, padded with valid but foreign block ids."""
    need = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(need) + 1
    tables = torch.randint(num_blocks, (len(context_lens), width), generator=gen)
    owned, start = [], 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n]
        owned.append(perm[start : start + n])
        start += n
    return tables, owned, num_blocks


def _poison_unused(cache: torch.Tensor, owned: list[torch.Tensor], context_lens: list[int]) -> torch.Tensor:
    """NaN in every slot outside a context: the kernel must never let one reach its output."""
    poisoned = torch.full_like(cache, float("nan"))
    flat_src, flat_dst = cache.flatten(0, 1), poisoned.flatten(0, 1)
    block_size = cache.shape[1]
    for blocks, ctx in zip(owned, context_lens):
        pos = torch.arange(ctx)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        flat_dst[slots] = flat_src[slots]
    return poisoned


DECODE_CASES = {
    # id: (heads, kv_heads, head_dim, block_size, context_lens, dtype, num_splits, block_n)
    "mha-fp32": (4, 4, 32, 16, [1, 16, 17, 45], torch.float32, None, None),
    "gqa2-fp32-d24-tiles-span-blocks": (4, 2, 24, 8, [1, 8, 9, 30, 70], torch.float32, None, 16),
    "gqa4-fp32-tile-inside-block": (8, 2, 64, 32, [33, 5, 64], torch.float32, None, 16),
    "gqa4-fp32-split3": (8, 2, 32, 16, [1, 50, 97], torch.float32, 3, 16),
    "mha-fp32-bs4-split4": (2, 2, 16, 4, [3, 4, 5, 61], torch.float32, 4, 16),
    "gqa2-fp32-d256": (2, 1, 256, 16, [5, 20], torch.float32, None, None),
    "gqa2-bf16-d128": (8, 4, 128, 16, [1, 16, 17, 40], torch.bfloat16, None, None),
    "gqa4-bf16-d80-split2": (8, 2, 80, 8, [9, 31, 64], torch.bfloat16, 2, 16),
    "mha-fp16": (2, 2, 64, 16, [7, 16, 33], torch.float16, None, None),
}


@interpreted
@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_paged_decode_matches_torch(triton_mods, case):
    kernels, _ = triton_mods
    heads, kv_heads, head_dim, block_size, context_lens, dtype, num_splits, block_n = case
    gen = torch.Generator().manual_seed(0)
    tables, owned, num_blocks = _tables(gen, context_lens, block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # A strided view, as q comes out of a fused QKV projection.
    q = torch.randn(len(context_lens), heads, head_dim + 8, generator=gen).to(dtype)[..., :head_dim]
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    ref = paged_decode(q, k_cache, v_cache, tables, lens, scale)
    out = kernels.triton_paged_decode(
        q, _poison_unused(k_cache, owned, context_lens), _poison_unused(v_cache, owned, context_lens),
        tables.to(torch.int32), lens, scale, max(context_lens), num_splits=num_splits, block_n=block_n,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


WRITE_CASES = {
    # id: (num_tokens, kv_heads, head_dim, block_size, src dtype, cache dtype)
    "fp32-d24": (12, 2, 24, 8, torch.float32, torch.float32),
    "bf16-4-kv-heads": (9, 4, 64, 16, torch.bfloat16, torch.bfloat16),
    "fp32-into-bf16": (7, 1, 128, 4, torch.float32, torch.bfloat16),
}


@interpreted
@pytest.mark.parametrize("case", WRITE_CASES.values(), ids=WRITE_CASES.keys())
def test_write_kv_matches_torch(triton_mods, case):
    kernels, _ = triton_mods
    num_tokens, kv_heads, head_dim, block_size, src_dtype, cache_dtype = case
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = 6
    # Key and value as strided halves of one fused tensor.
    kv = torch.randn(num_tokens, 2 * kv_heads, head_dim, generator=gen).to(src_dtype)
    key, value = kv[:, :kv_heads], kv[:, kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, num_tokens - 2]] = -1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    write_kv(key, value, k_ref, v_ref, slots)
    kernels.triton_write_kv(key, value, k_cache, v_cache, slots)
    if src_dtype == cache_dtype:
        # A copy: exact, untouched slots included.
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    else:
        # NOTE: on the GPU fp32->bf16 ``.to`` rounds to nearest even like torch; the 3.8 interpreter
        # truncates (cast_impl passes no rounding mode), so allow one bf16 ulp here.
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=2**-7)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()

    kernels.triton_write_kv(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    kernels.triton_write_kv(key[:0], value[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_forward_matches_torch_on_mixed_batch(triton_mods, dtype):
    """Three decodes, a fresh prefill chunk and a chunk continuing a cached context, in one flat batch."""
    _, backend = triton_mods
    from lm_engine.attention import get_backend

    assert isinstance(get_backend("cuda"), backend.TritonBackend)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    decode_ctx = [1, 8, 13]
    prefill = [(10, 10), (6, 21)]  # (chunk length, context length incl. the chunk)
    gen = torch.Generator().manual_seed(7)
    tables, _, num_blocks = _tables(gen, decode_ctx + [c for _, c in prefill], block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # earlier tokens' KV, and junk elsewhere
    v_cache = torch.randn(shape, generator=gen).to(dtype)

    def slot(seq: int, pos: int) -> int:
        return int(tables[seq, pos // block_size]) * block_size + pos % block_size

    slots = [slot(i, c - 1) for i, c in enumerate(decode_ctx)]
    spans, start = [], len(decode_ctx)
    for j, (q_len, ctx) in enumerate(prefill):
        seq = len(decode_ctx) + j
        slots += [slot(seq, p) for p in range(ctx - q_len, ctx)]
        spans.append((start, q_len, ctx))
        start += q_len
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decode_ctx),
        decode_block_tables=tables[: len(decode_ctx)].to(torch.int32),
        decode_context_lens=torch.tensor(decode_ctx, dtype=torch.int32),
        prefill_spans=spans,
        prefill_block_tables=[
            tables[len(decode_ctx) + j, : -(-c // block_size)] for j, (_, c) in enumerate(prefill)
        ],
        max_decode_context=max(decode_ctx),
    )
    num_tokens = start
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = TorchBackend().forward(q, k, v, k_ref, v_ref, meta, scale)
    out = backend.TritonBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_warmup_plan_covers_every_variant_traffic_can_pick():
    """Whatever batch and context lengths arrive, the decode launch is a variant the start-up warm-up has
    already compiled: unsplit, or split with a reduce width (BLOCK_P) in the plan."""
    import triton

    from lm_engine.attention import triton_kernels as kernels

    for num_sms, kv_heads, head_dim, max_model_len, max_num_seqs in [
        (132, 2, 128, 8192, 64),  # H200-class, Qwen2-VL-2B-like
        (108, 8, 64, 32768, 256),
        (16, 1, 256, 4096, 8),
    ]:
        plan = kernels.decode_warmup_plan(kv_heads, head_dim, max_model_len, num_sms)
        assert plan[0] == 1 and plan == sorted(set(plan))
        _, block_n = kernels._block_sizes(head_dim)
        widths = set()
        for num_seqs in range(1, max_num_seqs + 1):
            for context in sorted({1, 255, 256, 257, 1000, 4095, 4096, max_model_len // 3, max_model_len}):
                splits, tokens = kernels.split_layout(num_seqs * kv_heads, context, block_n, num_sms)
                assert splits * tokens >= context
                widths.add(1 if splits == 1 else triton.next_power_of_2(splits))
        assert widths <= set(plan), (widths, plan)
        assert len(plan) > 1  # these shapes do split: the plan is not trivially [1]


@interpreted
def test_warmup_runs_each_planned_variant(triton_mods):
    kernels, _ = triton_mods
    k_cache = torch.randn(4, 16, 2, 32)
    v_cache = torch.randn(4, 16, 2, 32)
    launched = []
    original = kernels.triton_paged_decode

    def spy(*args, num_splits=None, **kw):
        out = original(*args, num_splits=num_splits, **kw)
        launched.append(num_splits)
        assert torch.isfinite(out).all()
        return out

    kernels.triton_paged_decode = spy
    try:
        kernels.warmup_decode(torch.randn(1, 4, 32), k_cache, v_cache, [1, 2, 4])
    finally:
        kernels.triton_paged_decode = original
    assert launched == [1, 2, 4]
