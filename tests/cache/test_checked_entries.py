"""An entry read back from a cache tier must fit its key before anyone uses it: the model's dtype, one row
per merged token of the key's grid, the model's row width (every deepstack level). A malformed one (another
dtype or shape, truncated bytes, another level count) is a miss, deleted from Redis so no other reader trips
on it until its TTL, and counted in ``vlmserve_embedding_cache_invalid_total``. One check serves every path
(``EmbeddingLayout.problem``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from cache import EmbeddingCache, EmbeddingKey, EmbeddingLayout, MemoryTier, RedisTier, codec
from cache.metrics import EmbeddingCacheCollector
from tests.cache.test_cache_metrics import scrape

pytestmark = pytest.mark.redis
MakeKey = Callable[..., EmbeddingKey]

# grid (1, 4, 6) merged 2x2: 6 rows; rows 8 wide, float32
LAYOUT = EmbeddingLayout(merge_size=2, row_width=8, dtype=torch.float32)
GOOD = torch.arange(48, dtype=torch.float32).reshape(6, 8)


def malformed(key: EmbeddingKey) -> dict[str, bytes]:
    digest = key.digest()
    return {
        "dtype": codec.encode(digest, GOOD.double()),
        "rows": codec.encode(digest, torch.ones(7, 8)),
        "width": codec.encode(digest, torch.ones(6, 16)),
        "truncated": codec.encode(digest, GOOD)[:-3],
        "levels": codec.encode(digest, torch.ones(6, 8), levels=1),
    }


def test_layout_names_what_is_wrong(make_key: MakeKey) -> None:
    key = make_key(0)
    assert LAYOUT.problem(key, GOOD) is None
    assert "dtype" in LAYOUT.problem(key, GOOD.half())
    assert "shape" in LAYOUT.problem(key, GOOD[:5])
    assert "shape" in LAYOUT.problem(key, GOOD.reshape(-1))
    deep = EmbeddingKey(key.image_hash, key.grid, key.preprocess_fingerprint, key.model_fingerprint, 2)
    assert "levels" in EmbeddingLayout(2, 9, torch.float32, levels=0).problem(deep, torch.ones(6, 9))


def test_malformed_redis_entries_are_deleted_misses_and_counted(
    make_tier: Callable[..., RedisTier], prefix: str, make_key: MakeKey, redis_client: redis.Redis
) -> None:
    cache = EmbeddingCache(MemoryTier(1 << 20), make_tier(prefix=prefix))
    registry = CollectorRegistry()
    registry.register(EmbeddingCacheCollector(cache))
    kinds = list(malformed(make_key(0)))
    keys = {kind: make_key(i) for i, kind in enumerate(kinds)}
    for kind, key in keys.items():
        redis_client.set(cache.l2.redis_key(key), malformed(key)[kind])

    assert cache.get_many(list(keys.values()), LAYOUT.problem) == [None] * len(kinds)
    for kind, key in keys.items():
        assert redis_client.exists(cache.l2.redis_key(key)) == 0, f"{kind}: still in Redis"
    assert len(cache.l1) == 0  # nothing promoted
    stats = cache.l2.stats()
    assert (stats["invalid"], stats["misses"], stats["hits"]) == (len(kinds), len(kinds), 0)
    assert stats["breaker_state"] == "closed", "a malformed entry is not a backend failure"
    m = scrape(registry)
    assert m[("vlmserve_embedding_cache_invalid_total", (("tier", "redis"),))] == len(kinds)

    # The key is free for the right entry again: the next put is a hit for the next reader.
    cache.l2.put(keys["rows"], GOOD)
    assert cache.l2.flush()
    got = cache.get(keys["rows"], LAYOUT.problem)
    assert got is not None and torch.equal(got, GOOD)


def test_an_l1_entry_that_does_not_fit_is_dropped(make_key: MakeKey) -> None:
    cache = EmbeddingCache(MemoryTier(1 << 20))
    key = make_key(0)
    cache.put(key, GOOD[:5])
    assert cache.get(key, LAYOUT.problem) is None
    assert not cache.contains(key)
    assert cache.l1.stats()["invalid"] == 1 and cache.l1.stats()["entries"] == 0
    cache.put(key, GOOD)
    assert torch.equal(cache.get(key, LAYOUT.problem), GOOD)
