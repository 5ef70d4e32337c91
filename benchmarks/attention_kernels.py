"""Paged-KV attention kernels against the torch backend: time, achieved bandwidth, max abs diff.

    python benchmarks/attention_kernels.py [--block-size 16] [--seed 0]   # Triton, on a CUDA device
    python benchmarks/attention_kernels.py --cpu                          # the compiled CPU decode kernel

Decode reads every context token's K and V once, so its floor is KV bytes / memory bandwidth; the GB/s
column is that byte count over the measured time. Without a CUDA device only ``--cpu`` runs.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import sys
import time
from functools import partial

import torch

from lm_engine.attention.torch_backend import paged_decode, write_kv

# (label, num_seqs, heads, kv_heads, head_dim, context range, num_splits: None = the launcher's choice)
DECODE_CASES = [
    ("64 seqs, 1k ctx, MHA", 64, 16, 16, 128, (1024, 1024), None),
    ("64 seqs, 4k ctx, MHA", 64, 16, 16, 128, (4096, 4096), None),
    ("64 seqs, 1-4k ragged, MHA", 64, 16, 16, 128, (1, 4096), None),
    ("64 seqs, 1-4k ragged, GQA 8", 64, 16, 2, 128, (1, 4096), None),
    ("4 seqs, 4k ctx, GQA 8, auto split", 4, 16, 2, 128, (4096, 4096), None),
    ("4 seqs, 4k ctx, GQA 8, no split", 4, 16, 2, 128, (4096, 4096), 1),
]
WRITE_CASES = [("decode: 64 tokens", 64, 16, 128), ("prefill: 8192 tokens", 8192, 16, 128)]


def _bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _paged_kv(num_seqs, kv_heads, head_dim, block_size, context_lens, dtype, gen):
    """Caches holding every sequence's context in shuffled blocks, and the matching block tables."""
    need = [-(-int(c) // block_size) for c in context_lens]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables = torch.zeros(num_seqs, max(need), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    return k_cache, v_cache, tables


def bench_decode(block_size: int, gen: torch.Generator) -> None:
    from lm_engine.attention.triton_kernels import triton_paged_decode

    print(f"paged decode, bf16, head_dim 128, block_size {block_size}")
    header = (
        f"{'case':34} {'torch ms':>9} {'triton ms':>9} {'speedup':>8} {'triton GB/s':>11} {'max|diff|':>10}"
    )
    print(header)
    print("-" * len(header))
    dtype = torch.bfloat16
    for label, num_seqs, heads, kv_heads, head_dim, (lo, hi), splits in DECODE_CASES:
        lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen, device="cuda", dtype=torch.int32)
        k_cache, v_cache, tables = _paged_kv(
            num_seqs, kv_heads, head_dim, block_size, lens.tolist(), dtype, gen
        )
        q = torch.randn(num_seqs, heads, head_dim, generator=gen, device="cuda", dtype=dtype)
        scale, max_ctx = head_dim**-0.5, int(lens.max())

        run_torch = partial(paged_decode, q, k_cache, v_cache, tables, lens, scale, max_ctx)
        run_triton = partial(
            triton_paged_decode, q, k_cache, v_cache, tables, lens, scale, max_ctx, num_splits=splits
        )
        diff = (run_triton().float() - run_torch().float()).abs().max().item()
        t_torch, t_triton = _bench_ms(run_torch), _bench_ms(run_triton)
        kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * k_cache.element_size()
        print(
            f"{label:34} {t_torch:9.3f} {t_triton:9.3f} {t_torch / t_triton:7.1f}x "
            f"{kv_bytes / t_triton / 1e6:11.0f} {diff:10.2e}"
        )
        del k_cache, v_cache


def bench_write(block_size: int, gen: torch.Generator) -> None:
    from lm_engine.attention.triton_kernels import triton_write_kv

    print(f"\nKV write, bf16, block_size {block_size} (one slot in 8 is -1)")
    header = f"{'case':34} {'torch ms':>9} {'triton ms':>9} {'speedup':>8} {'identical':>10}"
    print(header)
    print("-" * len(header))
    dtype = torch.bfloat16
    for label, num_tokens, kv_heads, head_dim in WRITE_CASES:
        num_blocks = 2 * num_tokens // block_size + 1
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
        v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
        kv = torch.randn(num_tokens, 2 * kv_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
        key, value = kv[:, :kv_heads], kv[:, kv_heads:]  # strided, as out of a fused projection
        slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:num_tokens]
        slots[::8] = -1
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv(key, value, k_ref, v_ref, slots)
        triton_write_kv(key, value, k_cache, v_cache, slots)
        same = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        t_torch = _bench_ms(partial(write_kv, key, value, k_ref, v_ref, slots))
        t_triton = _bench_ms(partial(triton_write_kv, key, value, k_cache, v_cache, slots))
        print(f"{label:34} {t_torch:9.3f} {t_triton:9.3f} {t_torch / t_triton:7.1f}x {str(same):>10}")


# (label, num_seqs, heads, kv_heads, head_dim, context range): the small preset's attention shape
CPU_DECODE_CASES = [
    ("4 seqs, 10-40 ctx", 4, 12, 2, 64, (10, 40)),
    ("16 seqs, 100-1400 ctx", 16, 12, 2, 64, (100, 1400)),
    ("50 seqs, 100-1400 ctx", 50, 12, 2, 64, (100, 1400)),
    ("64 seqs, 300-1300 ctx", 64, 12, 2, 64, (300, 1300)),
    ("16 seqs, 1-4k ctx, MHA 128", 16, 16, 16, 128, (1, 4096)),
]


def _cpu_ms(fn, min_s: float = 0.5) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_s or n < 5:
        fn()
        n += 1
    return elapsed / n * 1e3


def bench_cpu_decode(block_size: int, seed: int) -> int:
    from runtime import paged_decode

    lib = paged_decode.load()
    if lib is None:
        print("attention_kernels --cpu: the kernel did not build (no C compiler?), nothing to measure")
        return 1
    gen = torch.Generator().manual_seed(seed)
    print(f"paged decode on the CPU, float32, block_size {block_size}, {torch.get_num_threads()} threads")
    header = (
        f"{'case':30} {'torch ms':>9} {'kernel ms':>9} {'speedup':>8} {'kernel GB/s':>11} {'max|diff|':>10}"
    )
    print(header)
    print("-" * len(header))
    for label, num_seqs, heads, kv_heads, head_dim, (lo, hi) in CPU_DECODE_CASES:
        lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen, dtype=torch.int32)
        need = [-(-int(c) // block_size) for c in lens]
        perm = torch.randperm(sum(need), generator=gen)
        tables = torch.zeros(num_seqs, max(need), dtype=torch.int32)
        start = 0
        for i, n in enumerate(need):
            tables[i, :n] = perm[start : start + n]
            start += n
        shape = (sum(need), block_size, kv_heads, head_dim)
        k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        q = torch.randn(num_seqs, heads, head_dim, generator=gen)
        scale, max_ctx = head_dim**-0.5, int(lens.max())
        run_torch = partial(paged_decode, q, k_cache, v_cache, tables, lens, scale, max_ctx)
        run_kernel = partial(
            paged_decode.paged_decode, lib, q, k_cache, v_cache, tables, lens, scale, max_ctx
        )
        diff = (run_kernel() - run_torch()).abs().max().item()
        t_torch, t_kernel = _cpu_ms(run_torch), _cpu_ms(run_kernel)
        kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * 4
        print(
            f"{label:30} {t_torch:9.2f} {t_kernel:9.2f} {t_torch / t_kernel:7.1f}x "
            f"{kv_bytes / t_kernel / 1e6:11.1f} {diff:10.2e}"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="the compiled CPU decode kernel against torch")
    args = parser.parse_args()
    if args.cpu:
        return bench_cpu_decode(args.block_size, args.seed)
    if not torch.cuda.is_available():
        print("attention_kernels: no CUDA device, so no Triton measurement (the Triton kernels are tested on")
        print(
            "the CPU by tests/test_triton_kernels.py under TRITON_INTERPRET=1); --cpu measures the CPU kernel."
        )
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    bench_decode(args.block_size, gen)
    bench_write(args.block_size, gen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
