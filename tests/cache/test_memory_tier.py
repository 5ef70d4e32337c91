from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
import torch

from cache import EmbeddingKey, MemoryTier

MakeKey = Callable[..., EmbeddingKey]


def emb(nbytes: int, fill: float = 1.0) -> torch.Tensor:
    assert nbytes % 4 == 0
    return torch.full((nbytes // 4,), fill, dtype=torch.float32)


def test_lru_evicts_least_recently_used_first(make_key: MakeKey) -> None:
    a, b, c, d = (make_key(i) for i in range(4))
    tier = MemoryTier(capacity_bytes=300)
    for k in (a, b, c):
        tier.put(k, emb(100))
    assert tier.get(a) is not None  # a is now most recent; b is the oldest
    tier.put(d, emb(100))
    assert tier.lru_order() == [c, a, d]
    assert tier.get(b) is None
    assert tier.stats() == {
        "hits": 1,
        "misses": 1,
        "evictions": 1,
        "rejected": 0,
        "entries": 3,
        "bytes": 300,
        "capacity_bytes": 300,
    }


def test_one_large_entry_evicts_several(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=400)
    for i in range(4):
        tier.put(make_key(i), emb(100))
    tier.put(make_key(9), emb(240))
    assert tier.lru_order() == [make_key(3), make_key(9)]
    assert tier.stats()["bytes"] == 340


def test_entry_larger_than_capacity_is_not_stored(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=200)
    tier.put(make_key(0), emb(100))
    tier.put(make_key(1), emb(204))
    assert tier.lru_order() == [make_key(0)]
    # Replacing a key with an oversize value drops the stale old value too.
    tier.put(make_key(0), emb(400, fill=2.0))
    assert tier.get(make_key(0)) is None
    assert tier.stats()["rejected"] == 2 and tier.stats()["bytes"] == 0


def test_replacing_a_key_updates_value_and_bytes(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=1000)
    tier.put(make_key(0), emb(100, fill=1.0))
    tier.put(make_key(0), emb(200, fill=2.0))
    got = tier.get(make_key(0))
    assert got is not None and torch.equal(got, emb(200, fill=2.0))
    assert tier.stats()["bytes"] == 200 and len(tier) == 1


def test_contains_counts_nothing_and_keeps_recency(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=200)
    tier.put(make_key(0), emb(100))
    tier.put(make_key(1), emb(100))
    assert tier.contains(make_key(0)) and not tier.contains(make_key(5))
    tier.put(make_key(2), emb(100))  # key 0 is still the LRU entry despite the contains()
    assert tier.lru_order() == [make_key(1), make_key(2)]
    assert tier.stats()["hits"] == 0 and tier.stats()["misses"] == 0


def test_a_view_of_a_larger_tensor_is_stored_compactly(make_key: MakeKey) -> None:
    batch = torch.randn(1000, 64)  # e.g. a packed encoder output for many images
    view = batch[10:20]
    tier = MemoryTier(capacity_bytes=1 << 20)
    tier.put(make_key(0), view)
    stored = tier.get(make_key(0))
    assert stored is not None and torch.equal(stored, view)
    assert stored.untyped_storage().nbytes() == view.nbytes == tier.stats()["bytes"]


def model_put(model: list[tuple[int, int]], key: int, size: int, cap: int) -> list[tuple[int, int]]:
    """Oracle: the LRU as a plain list, least recent first."""
    model = [(k, s) for k, s in model if k != key]
    if size > cap:
        return model
    while sum(s for _, s in model) + size > cap:
        model.pop(0)
    return [*model, (key, size)]


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_list_model_under_random_operations(make_key: MakeKey, seed: int) -> None:
    rng = random.Random(seed)
    cap = 1000
    tier = MemoryTier(capacity_bytes=cap)
    model: list[tuple[int, int]] = []
    values: dict[int, float] = {}
    for step in range(600):
        k = rng.randrange(12)
        if rng.random() < 0.5:
            size = 4 * rng.randrange(0, 330)  # sometimes above the capacity
            tier.put(make_key(k), emb(size, fill=float(step)))
            model = model_put(model, k, size, cap)
            values[k] = float(step)
        else:
            got = tier.get(make_key(k))
            in_model = any(mk == k for mk, _ in model)
            assert (got is not None) == in_model
            if got is not None:
                model = [e for e in model if e[0] != k] + [e for e in model if e[0] == k]
                assert got.numel() == 0 or got[0].item() == values[k]
        assert tier.lru_order() == [make_key(k) for k, _ in model]
        assert tier.stats()["bytes"] == sum(s for _, s in model) <= cap


def test_concurrent_use_keeps_the_byte_accounting_exact(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=4096)
    n_gets = [0] * 4

    def worker(w: int) -> None:
        rng = random.Random(w)
        for _ in range(3000):
            key = make_key(rng.randrange(40))
            if rng.random() < 0.5:
                tier.put(key, emb(4 * rng.randrange(1, 200)))
            else:
                tier.get(key)
                n_gets[w] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = tier.stats()
    held = [tier.get(k) for k in tier.lru_order()]
    assert stats["bytes"] == sum(t.nbytes for t in held if t is not None) <= 4096
    assert stats["hits"] + stats["misses"] == sum(n_gets)
