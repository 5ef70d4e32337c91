"""The compiled CPU decode kernel against the torch backend's gather + SDPA decode."""

from __future__ import annotations

import logging
import multiprocessing as mp

import pytest
import torch

from lm_engine.attention import CpuBackend, TorchBackend, get_backend
from lm_engine.attention.torch_backend import paged_decode
from runtime import paged_decode as decode_kernel
from tests.support import prerequisite

LIB = decode_kernel.load()
_kernel_built = prerequisite(
    None if LIB else "the paged decode kernel did not build (no C compiler, or VLMSERVE_CPU_KERNELS=0)"
)


def _case(seed, lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, spare=5):
    """Random paged caches; each sequence owns shuffled blocks, the table's tail holds foreign block ids."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(num_blocks, (len(lens), max(need) + 2), generator=gen, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n].int()
        start += n
    q = (torch.randn(len(lens), num_heads, head_dim, generator=gen) * 2).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


SHAPES = [
    # (lens, heads, kv heads, head_dim, block_size): the small preset's shape, MHA, an odd group with a
    # head_dim that is not a multiple of 64 (the kernel's tail loops), one-token blocks, long contexts.
    ([1, 16, 17, 100, 1403, 640], 12, 2, 64, 16),
    ([5, 33, 64], 8, 8, 128, 16),
    ([7, 300, 301], 14, 2, 72, 32),
    ([1, 2, 9], 4, 1, 8, 1),
    ([2048, 1500, 3], 16, 4, 64, 16),
]


@pytest.mark.parametrize("lens,h,kvh,d,bs", SHAPES)
def test_kernel_matches_torch_decode(lens, h, kvh, d, bs):
    q, k, v, tables, ctx = _case(len(lens) * 31 + d, lens, h, kvh, d, bs)
    scale = d**-0.5
    ref = paged_decode(q, k, v, tables, ctx, scale)
    got = decode_kernel.paged_decode(LIB, q, k, v, tables, ctx, scale, max(lens))
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)


def test_threads_do_not_change_the_result():
    q, k, v, tables, ctx = _case(3, [900, 5, 1200, 77, 640, 33], 12, 2, 64, 16)
    outs = [
        decode_kernel.paged_decode(LIB, q, k, v, tables, ctx, 0.125, 1200, num_threads=n) for n in (1, 2, 3)
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_large_scores_do_not_overflow():
    """Scores in the hundreds: the running max keeps every exponent <= 0."""
    q, k, v, tables, ctx = _case(5, [50, 400], 4, 2, 16, 16)
    ref = paged_decode(q * 40, k, v, tables, ctx, 1.0)
    got = decode_kernel.paged_decode(LIB, q * 40, k, v, tables, ctx, 1.0, 400)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("lens,h,kvh,d,bs", SHAPES)
def test_bfloat16_is_as_close_to_float32_as_torch_bf16(lens, h, kvh, d, bs):
    """bf16 caches and query, widened to float32 in the kernel: its error against float32 attention on the
    same (bf16) values stays within what torch's bf16 gather + SDPA makes (mostly the output's rounding)."""
    q, k, v, tables, ctx = _case(len(lens) * 17 + d, lens, h, kvh, d, bs, dtype=torch.bfloat16)
    scale = d**-0.5
    exact = paged_decode(q.float(), k.float(), v.float(), tables, ctx, scale)
    theirs = (paged_decode(q, k, v, tables, ctx, scale).float() - exact).abs()
    got = decode_kernel.paged_decode(LIB, q, k, v, tables, ctx, scale, max(lens))
    assert got.dtype == torch.bfloat16
    ours = (got.float() - exact).abs()
    assert ours.max() <= theirs.max() + 1e-3 and ours.mean() <= 1.1 * theirs.mean(), (
        ours.max(),
        theirs.max(),
    )


def test_backend_decodes_in_the_kernel(monkeypatch):
    """Shapes the kernel takes never reach gather + SDPA. (The backend's decode once slipped out of its class,
    below a module-level function, and every decode step ran the torch path unnoticed.)"""
    import lm_engine.attention.torch_backend as torch_backend

    def refuse(*args, **kwargs):
        raise AssertionError("decode fell back to gather + SDPA")

    backend = CpuBackend(LIB)
    monkeypatch.setattr(torch_backend, "paged_decode", refuse)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, tables, ctx = _case(7, [20, 70], 4, 2, 64, 16, dtype=dtype)
        got = backend.decode(q, k, v, tables, ctx, 0.3, 70)
        assert torch.equal(got, decode_kernel.paged_decode(LIB, q, k, v, tables, ctx, 0.3, 70))


def test_backend_falls_back_outside_the_kernel():
    backend = CpuBackend(LIB)
    for dtype, d in ((torch.float16, 64), (torch.float32, 12)):  # not float32/bf16; head_dim % 8 != 0
        q, k, v, tables, ctx = _case(7, [20, 70], 4, 2, d, 16, dtype=dtype)
        assert not decode_kernel.supports(q, k)
        got = backend.decode(q, k, v, tables, ctx, 0.3, 70)
        assert torch.equal(got, paged_decode(q, k, v, tables, ctx, 0.3, 70))


def test_context_beyond_the_block_table_is_refused():
    q, k, v, tables, ctx = _case(9, [20, 40], 4, 2, 16, 16)
    narrow = tables[:, :1]  # one block per sequence, but contexts of 20 and 40 tokens
    with pytest.raises(ValueError, match="exceeds the block table"):
        decode_kernel.paged_decode(LIB, q, k, v, narrow, ctx, 0.25, 40)
    with pytest.raises(ValueError, match="exceeds the block table"):  # an understated max_context too
        decode_kernel.paged_decode(LIB, q, k, v, narrow, ctx, 0.25, 16)


def test_backend_reads_each_steps_lengths_once_and_still_checks_them():
    """A step's layers share one lengths tensor, whose max the backend reads once; a new step's tensor is read
    again (longer contexts are attended in full), and one past its block table is still refused."""
    backend = CpuBackend(LIB)
    q, k, v, tables, ctx = _case(13, [20, 40], 4, 2, 16, 16)
    for _ in range(2):  # two layers of one step
        got = backend.decode(q, k, v, tables, ctx, 0.25, 40)
        assert torch.equal(got, decode_kernel.paged_decode(LIB, q, k, v, tables, ctx, 0.25, 40))
    longer = torch.tensor([21, 47], dtype=torch.int32)  # the next step
    got = backend.decode(q, k, v, tables, longer, 0.25, 47)
    torch.testing.assert_close(got, paged_decode(q, k, v, tables, longer, 0.25), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="exceeds the block table"):
        backend.decode(q, k, v, tables[:, :1], torch.tensor([20, 40], dtype=torch.int32), 0.25, 16)


def _meta(slots, decode_ctx, tables, all_written=False):
    from lm_engine.attention.base import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decode_ctx),
        decode_block_tables=tables,
        decode_context_lens=torch.tensor(decode_ctx, dtype=torch.int32),
        prefill_spans=[],
        prefill_block_tables=[],
        max_decode_context=max(decode_ctx),
        all_slots_written=all_written,
    )


@pytest.mark.parametrize("backend", [TorchBackend(), CpuBackend(LIB)], ids=["torch", "cpu"])
def test_decode_only_step_writes_its_kv_and_attends(backend):
    """A step of decodes only: the layer's output is the decode's, its KV is written at its slots (the step
    builder's ``all_slots_written``) and a -1 slot (flag not set) writes nothing."""
    q, k_cache, v_cache, tables, _ = _case(17, [9, 30], 4, 2, 16, 8)
    lens = [9, 30]
    slots = [int(tables[i, (n - 1) // 8]) * 8 + (n - 1) % 8 for i, n in enumerate(lens)]
    k = torch.randn(2, 2, 16)
    v = torch.randn(2, 2, 16)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, kc, vc, _meta(slots, lens, tables, all_written=True), 0.25)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    torch.testing.assert_close(
        out, paged_decode(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.25)
    )
    kc2 = k_cache.clone()
    backend.forward(q, k, v, kc2, v_cache.clone(), _meta([slots[0], -1], lens, tables), 0.25)
    assert torch.equal(kc2.view(-1, 2, 16)[slots[0]], k[0])
    changed = (kc2 != k_cache).any(dim=-1).any(dim=-1).flatten().nonzero().flatten().tolist()
    assert changed == [slots[0]]  # the first sequence's slot only


def _decode_in_child(conn):
    try:
        # NOTE: torch's own OpenMP threads do not survive fork either; the reference runs on one thread.
        torch.set_num_threads(1)
        q, k, v, tables, ctx = _case(11, [800, 900, 700, 1000], 12, 2, 64, 16)
        got = decode_kernel.paged_decode(
            decode_kernel.load(), q, k, v, tables, ctx, 0.125, 1000, num_threads=2
        )
        conn.send(bool(torch.allclose(got, paged_decode(q, k, v, tables, ctx, 0.125), atol=2e-6)))
    except Exception as exc:  # report, do not hang the parent
        conn.send(repr(exc))


def test_pool_works_after_fork():
    """The kernel's thread pool exists in the parent; a forked child (no threads but its own) must
    start a fresh pool instead of waiting on threads it does not have."""
    q, k, v, tables, ctx = _case(13, [800, 900, 700, 1000], 12, 2, 64, 16)
    decode_kernel.paged_decode(LIB, q, k, v, tables, ctx, 0.125, 1000, num_threads=2)  # the parent's pool
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_decode_in_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(30), "the forked child hung in the kernel"
        assert parent.recv() is True
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_get_backend_choices(monkeypatch, tmp_path, caplog):
    assert isinstance(get_backend("cpu", "auto"), CpuBackend)
    assert isinstance(get_backend("cpu", "torch"), TorchBackend)
    assert not isinstance(get_backend("cpu", "torch"), CpuBackend)
    monkeypatch.setenv("VLMSERVE_KERNEL_CACHE", str(tmp_path))
    try:
        # A compiler that fails: auto falls back to torch with a warning, "cpu" refuses to start.
        monkeypatch.setenv("CC", "false")
        decode_kernel.load.cache_clear()
        with caplog.at_level(logging.WARNING, logger="vlmserve.engine"):
            backend = get_backend("cpu", "auto")
        assert type(backend) is TorchBackend
        assert "kernel unavailable" in caplog.text
        with pytest.raises(RuntimeError, match="did not build"):
            get_backend("cpu", "cpu")
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
        # Switched off.
        monkeypatch.setenv("CC", "cc")
        monkeypatch.setenv("VLMSERVE_CPU_KERNELS", "0")
        decode_kernel.load.cache_clear()
        assert type(get_backend("cpu", "auto")) is TorchBackend
        # A fresh build into an empty cache works and lands there.
        monkeypatch.delenv("VLMSERVE_CPU_KERNELS")
        decode_kernel.load.cache_clear()
        assert isinstance(get_backend("cpu", "auto"), CpuBackend)
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
    finally:
        decode_kernel.load.cache_clear()
