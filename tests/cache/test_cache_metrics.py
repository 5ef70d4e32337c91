from __future__ import annotations

from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache import EmbeddingCache, EmbeddingKey, MemoryTier, RedisTier
from cache.metrics import EmbeddingCacheCollector


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_scrape_reflects_both_tiers(
    make_tier: Callable[..., RedisTier], make_key: Callable[..., EmbeddingKey], refused_port: int
) -> None:
    cache = EmbeddingCache(
        MemoryTier(1 << 20),
        make_tier(f"redis://127.0.0.1:{refused_port}/0", failure_threshold=2, async_puts=False),
    )
    registry = CollectorRegistry()
    registry.register(EmbeddingCacheCollector(cache))
    cache.put(make_key(0), torch.zeros(64))  # 256 bytes of data in L1; the L2 write is refused
    cache.get(make_key(0))
    for i in range(1, 4):
        cache.get(make_key(i))  # L1 misses; L2 refused once more (breaker opens), then skipped

    m = scrape(registry)
    ns = "vlmserve_embedding_cache"
    assert m[(f"{ns}_hits_total", (("tier", "memory"),))] == 1
    assert m[(f"{ns}_misses_total", (("tier", "memory"),))] == 3
    # Charged with the entry's objects and the tier's table (tests/cache/test_memory_tier.py checks those).
    assert m[(f"{ns}_bytes", (("tier", "memory"),))] == cache.l1.stats()["bytes"] > 256
    assert m[(f"{ns}_misses_total", (("tier", "redis"),))] == 3
    assert m[(f"{ns}_errors_total", (("tier", "redis"),))] == 2
    assert m[(f"{ns}_short_circuited_total", (("tier", "redis"),))] == 2
    assert m[(f"{ns}_dropped_puts_total", (("tier", "redis"),))] == 1
    assert m[(f"{ns}_breaker_state", (("state", "open"), ("tier", "redis")))] == 1
    assert m[(f"{ns}_breaker_state", (("state", "closed"), ("tier", "redis")))] == 0
    assert m[(f"{ns}_breaker_opens_total", (("tier", "redis"),))] == 1
