"""Triton kernels for the paged KV cache: the KV write and flash-decoding-style paged decode.

Both take arbitrary strides, so q/k/v may be views into a fused QKV projection. Head dims are padded to
a power of two (at least 16, for ``tl.dot``) and masked; cache offsets are computed in int64 because a
large pool overflows int32 element offsets.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the extra parallelism


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, block_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per token writes all its KV heads: [BLOCK_H, BLOCK_D] tiles.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # NOTE: slot -1 (padding, or a token whose KV is already cached) folds into the mask: no write.
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)
    blk = slot // block_size
    off = slot % block_size

    k = tl.load(
        key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask
    )
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs
    tl.store(
        kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    v = tl.load(
        value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask
    )
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs
    tl.store(
        vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def triton_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ([T, KVH, D]) into ``[num_blocks, block_size, KVH, D]`` caches (-1 = skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    # NOTE: "ieee" keeps fp32 inputs off TF32 tensor cores (16-bit inputs are unaffected). DOT_FP32 is
    # for the interpreter, whose tl.dot multiplies bf16 bit patterns (triton#11584); the upcast is exact,
    # so it computes what the GPU's bf16 MMA with fp32 accumulation does.
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


# NOTE: ints that change from step to step (the table's row stride grows with the longest context; the split
# partials' strides with the split count) are not specialised on, so each kernel compiles once per variant at
# start-up (see decode_warmup_plan), not again on live traffic when a value turns divisible by 16 or equal to 1.
@triton.jit(
    do_not_specialize=["tokens_per_split", "stride_bts", "stride_os", "stride_oh", "stride_op", "stride_ms",
                       "stride_mh"]
)  # fmt: skip
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, m_ptr, l_ptr,
    scale_log2, block_size, tokens_per_split,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_op, stride_od, stride_ms, stride_mh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Program (seq, kv head, split): all GROUP query heads of one KV head over one token range.

    Query heads sharing a KV head are rows of one [BLOCK_G, D] tile, so each K/V tile is loaded once
    per group and both products are ``tl.dot``s (BLOCK_G >= 16; padded rows are masked on store).
    A tile of BLOCK_N tokens may span several KV blocks: each token looks its block up in the table.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(ctx, start + tokens_per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    gd_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
    d_mask = offs_d[None, :] < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=gd_mask,
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd

    # Online softmax in the log2 domain, fp32 state: running max, running denominator, unnormalised sum.
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        blk = tl.load(table + (pos // block_size) * stride_btb, mask=n_mask, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask
        k = tl.load(k_head + (blk * stride_kb + off * stride_kt)[:, None], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (blk * stride_vb + off * stride_vt)[:, None], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    out = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    if SPLIT:
        # Partial state for the reduce kernel; an empty split leaves m = -inf, l = 0, acc = 0.
        tl.store(out + split * stride_op, acc, mask=gd_mask)
        ml = seq * stride_ms + heads * stride_mh + split
        tl.store(m_ptr + ml, m_i, mask=offs_g < GROUP)
        tl.store(l_ptr + ml, l_i, mask=offs_g < GROUP)
    else:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # an empty context yields zeros, not NaN
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_ph", "stride_pp", "stride_ms", "stride_mh"])
def _reduce_splits_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_pp, stride_pd, stride_ms, stride_mh, stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    # One program per (seq, query head) merges the splits' (max, denominator, sum) triples.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < num_splits
    ml = seq * stride_ms + head * stride_mh + offs_p
    m = tl.load(m_ptr + ml, mask=p_mask, other=float("-inf"))
    l_part = tl.load(l_ptr + ml, mask=p_mask, other=0.0)
    part = part_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph
    acc = tl.load(
        part + offs_p[:, None] * stride_pp + offs_d[None, :] * stride_pd,
        mask=p_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    den = tl.sum(l_part * w, 0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.where(den > 0, den, 1.0)
    out = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(out, (num / den).to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# The interpreter (TRITON_INTERPRET=1 when this module was imported) swaps in InterpretedFunction.
_INTERPRETED = not isinstance(_paged_decode_kernel, triton.runtime.JITFunction)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def split_layout(num_programs: int, max_context: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """(splits, tokens per split) of a decode launch: the context is split only when the (seq, kv head)
    programs alone would leave SMs idle, and never into a split that is empty for every sequence."""
    target = 2 * num_sms
    wanted = 1
    if num_programs < target:
        wanted = max(1, min(math.ceil(target / num_programs), max_context // _MIN_TOKENS_PER_SPLIT))
    return _layout_of(wanted, max_context, block_n)


def _layout_of(splits: int, max_context: int, block_n: int) -> tuple[int, int]:
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    return max(1, triton.cdiv(max_context, tokens_per_split)), tokens_per_split


def _block_sizes(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N) for a head dim: padded to a power of two ≥ 16 (tl.dot), smaller tiles past 128."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return block_d, 64 if block_d <= 128 else 32


def decode_warmup_plan(num_kv_heads: int, head_dim: int, max_model_len: int, num_sms: int) -> list[int]:
    """Split counts whose launches compile every decode kernel variant live traffic can reach: the unsplit
    kernel, and the split kernel with each width of the reduce kernel (BLOCK_P, a power of two)."""
    _, block_n = _block_sizes(head_dim)
    most, _ = split_layout(num_kv_heads, max_model_len, block_n, num_sms)  # one sequence: the most splits
    plan, width = [1], 2
    while width <= triton.next_power_of_2(most):
        plan.append(width)
        width *= 2
    return plan


def warmup_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[int]) -> None:
    """Compile the decode variants of ``plan`` before live traffic: ``q`` is one query ([1, H, D]); every
    context reads block 0 of the caches, so nothing is allocated for it."""
    _, block_n = _block_sizes(q.shape[2])
    block_size = k_cache.shape[1]
    for splits in plan:
        context = splits * max(block_n, _MIN_TOKENS_PER_SPLIT)
        tables = torch.zeros(1, triton.cdiv(context, block_size), dtype=torch.int32, device=q.device)
        lens = torch.full((1,), context, dtype=torch.int32, device=q.device)
        triton_paged_decode(q, k_cache, v_cache, tables, lens, 1.0, context, num_splits=splits)


def triton_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int = 0,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """One query per sequence ([S, H, D]) against its paged context; returns [S, H, D] in q's dtype.

    ``max_context`` (>= every context length) sizes the splits; 0 reads it from ``context_lens``, a
    device sync, so callers that know it (and CUDA-graph capture) should pass it. ``num_splits``/``block_n``
    override the heuristics (tests, tuning).
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if max_context <= 0:
        max_context = int(context_lens.max())
    group = num_heads // num_kv_heads
    block_d, default_n = _block_sizes(head_dim)
    block_n = block_n or default_n
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 16 (tl.dot)"
    if num_splits:
        splits, tokens_per_split = _layout_of(num_splits, max_context, block_n)
    elif q.device.type == "cuda":
        splits, tokens_per_split = split_layout(
            num_seqs * num_kv_heads, max_context, block_n, _device_sms(q.device)
        )
    else:
        splits, tokens_per_split = 1, max_context
    common = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, DOT_FP32=_INTERPRETED, num_warps=4, num_stages=2,
    )  # fmt: skip
    grid = (num_seqs, num_kv_heads, splits)
    if splits == 1:
        # One range covers any context, so a stale max_context cannot cut a sequence short here.
        _paged_decode_kernel[grid](
            q, k_cache, v_cache, block_tables, context_lens, out, out, out,
            scale * _LOG2E, block_size, 1 << 30,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            out.stride(0), out.stride(1), 0, out.stride(2), 0, 0,
            SPLIT=False, **common,
        )  # fmt: skip
        return out

    part = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    m = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, part, m, l_sum,
        scale * _LOG2E, block_size, tokens_per_split,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *part.stride(), m.stride(0), m.stride(1),
        SPLIT=True, **common,
    )  # fmt: skip
    _reduce_splits_kernel[(num_seqs, num_heads)](
        part, m, l_sum, out, splits, *part.stride(), m.stride(0), m.stride(1), *out.stride(),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(splits), num_warps=4,
    )  # fmt: skip
    return out
