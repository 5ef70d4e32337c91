"""The KV pool's zero-filled CPU tensor: equal to torch.zeros, writable, alive on its own, and not written at
start-up (its pages become resident only when a step reaches them)."""

from __future__ import annotations

import gc

import torch

from lm_engine.memory import zeroed_pool
from runtime.memory import rss_bytes


def test_the_pool_reads_as_zeros_and_takes_writes():
    shape = (2, 2, 7, 16, 2, 8)
    pool = zeroed_pool(shape, torch.bfloat16, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert torch.equal(pool, torch.zeros(shape, dtype=torch.bfloat16))
    pool[1, 0, 3].fill_(2.0)
    expected = torch.zeros(shape, dtype=torch.bfloat16)
    expected[1, 0, 3] = 2.0
    assert torch.equal(pool, expected)


def test_the_tensor_keeps_its_memory_alive():
    views = [zeroed_pool((4, 1024), torch.float32, torch.device("cpu"))[i] for i in range(4)]
    gc.collect()
    for v in views:
        v += 1.0
    assert all(torch.equal(v, torch.ones(1024)) for v in views)


def test_a_large_pool_is_not_written_at_start():
    before = rss_bytes()
    pool = zeroed_pool((512, 1 << 20), torch.uint8, torch.device("cpu"))  # 512 MiB
    grown = rss_bytes() - before
    assert grown < 64 << 20, f"creating the pool made {grown >> 20} MiB resident"
    pool[0].fill_(1)  # one touched row becomes resident, the rest stays untouched
    assert int(pool[0].sum()) == 1 << 20 and int(pool[1].sum()) == 0
