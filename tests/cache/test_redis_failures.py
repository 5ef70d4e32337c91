"""Redis down, hung, or back again: requests stay fast and the tier recovers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cache import EmbeddingCache, EmbeddingKey, MemoryTier, RedisTier

MakeKey = Callable[..., EmbeddingKey]
MakeTier = Callable[..., RedisTier]
TIMEOUT_S = 0.05  # make_tier's connect and read timeouts


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_refused_connections_fail_fast_and_open_the_breaker(
    make_tier: MakeTier, make_key: MakeKey, refused_port: int
) -> None:
    tier = make_tier(f"redis://127.0.0.1:{refused_port}/0", failure_threshold=3, cooldown_s=60)
    results, elapsed = timed(lambda: [tier.get(make_key(i)) for i in range(50)])
    assert results == [None] * 50
    assert elapsed < 1.0
    stats = tier.stats()
    assert (stats["errors"], stats["short_circuited"], stats["misses"]) == (3, 47, 50)
    assert (stats["breaker_state"], stats["breaker_opens"]) == ("open", 1)


def test_a_hung_server_costs_at_most_threshold_timeouts(
    make_tier: MakeTier, make_key: MakeKey, black_hole: int
) -> None:
    tier = make_tier(f"redis://127.0.0.1:{black_hole}/0", failure_threshold=3, cooldown_s=60)
    results, elapsed = timed(lambda: [tier.get(make_key(i)) for i in range(50)])
    assert results == [None] * 50
    # Three calls each wait out a timeout (proving the server hung rather than refused) ...
    assert elapsed >= 3 * TIMEOUT_S * 0.9
    # ... and no call waits more than a connect plus a read timeout; the other 47 cost nothing.
    assert elapsed < 3 * 2 * TIMEOUT_S + 0.5
    stats = tier.stats()
    assert (stats["errors"], stats["short_circuited"], stats["breaker_state"]) == (3, 47, "open")


def test_puts_never_block_on_a_hung_server(make_tier: MakeTier, make_key: MakeKey, black_hole: int) -> None:
    tier = make_tier(f"redis://127.0.0.1:{black_hole}/0", failure_threshold=3, max_pending_puts=8)
    value = torch.zeros(64, 256)
    _, elapsed = timed(lambda: [tier.put(make_key(i), value) for i in range(200)])
    assert elapsed < 0.25
    _, close_s = timed(tier.close)
    assert close_s < 1.5
    stats = tier.stats()
    assert (stats["puts"], stats["dropped_puts"], stats["pending_puts"]) == (0, 200, 0)
    assert stats["errors"] >= 1


def test_a_failed_trial_reopens_the_breaker(
    make_tier: MakeTier, make_key: MakeKey, refused_port: int
) -> None:
    clock = FakeClock()
    tier = make_tier(f"redis://127.0.0.1:{refused_port}/0", failure_threshold=2, cooldown_s=10, clock=clock)
    for i in range(5):
        tier.get(make_key(i))
    clock.now += 10
    assert tier.get(make_key(0)) is None  # the half-open trial, still refused
    stats = tier.stats()
    assert (stats["errors"], stats["breaker_opens"], stats["breaker_state"]) == (3, 2, "open")


def test_l1_keeps_serving_while_l2_hangs(make_tier: MakeTier, make_key: MakeKey, black_hole: int) -> None:
    cache = EmbeddingCache(MemoryTier(1 << 20), make_tier(f"redis://127.0.0.1:{black_hole}/0"))
    _, put_s = timed(lambda: [cache.put(make_key(i), torch.ones(8, 8)) for i in range(20)])
    hits, hit_s = timed(lambda: cache.get_many([make_key(i) for i in range(20)]))
    assert all(h is not None for h in hits)  # type: ignore[union-attr]
    l2 = cache.stats()["redis"]
    assert l2["misses"] == l2["hits"] == 0, "L1 hits must not consult L2"
    assert put_s < 0.2 and hit_s < 0.2
    missing, miss_s = timed(lambda: cache.get(make_key(99)))
    assert missing is None and miss_s < 2 * TIMEOUT_S + 0.25


@pytest.mark.redis
def test_redis_coming_back_is_used_again(
    make_tier: MakeTier, make_key: MakeKey, prefix: str, redis_proxy: Any, redis_url: str
) -> None:
    clock = FakeClock()
    url = redis_url.replace(":6379/", f":{redis_proxy.port}/")
    tier = make_tier(url, prefix=prefix, failure_threshold=3, cooldown_s=5.0, clock=clock, async_puts=False)
    value = torch.randn(16, 16)
    tier.put(make_key(1), value)
    assert tier.get(make_key(1)) is not None

    redis_proxy.mode = "blackhole"
    assert [tier.get(make_key(1)) for _ in range(3)] == [None] * 3
    assert tier.stats()["breaker_state"] == "open"
    seen = redis_proxy.request_bytes
    results, elapsed = timed(lambda: [tier.get(make_key(1)) for _ in range(50)])
    assert results == [None] * 50 and elapsed < 0.2
    assert redis_proxy.request_bytes == seen, "an open breaker must not touch Redis"

    redis_proxy.mode = "forward"
    assert tier.get(make_key(1)) is None, "still cooling down"
    clock.now += 5.0
    got = tier.get(make_key(1))  # the half-open trial succeeds
    assert got is not None and torch.equal(got, value)
    assert tier.stats()["breaker_state"] == "closed"
    tier.put(make_key(2), value)
    assert tier.get(make_key(2)) is not None
    stats = tier.stats()
    assert (stats["errors"], stats["breaker_opens"], stats["hits"]) == (3, 1, 3)


@pytest.mark.redis
def test_puts_alone_bring_the_tier_back(
    make_tier: MakeTier, make_key: MakeKey, prefix: str, redis_proxy: Any, redis_url: str
) -> None:
    clock = FakeClock()
    url = redis_url.replace(":6379/", f":{redis_proxy.port}/")
    tier = make_tier(url, prefix=prefix, failure_threshold=2, cooldown_s=5.0, clock=clock)
    redis_proxy.mode = "blackhole"
    for i in range(10):
        tier.put(make_key(i), torch.ones(4))
        assert tier.flush()
    assert tier.stats()["breaker_state"] == "open"

    redis_proxy.mode = "forward"
    clock.now += 5.0
    tier.put(make_key(100), torch.ones(4))  # the writer's SET is the half-open trial
    assert tier.flush()
    stats = tier.stats()
    assert (stats["breaker_state"], stats["puts"], stats["dropped_puts"]) == ("closed", 1, 10)
    assert tier.get(make_key(100)) is not None
