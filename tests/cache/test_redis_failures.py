"""Redis down, hung, or back again: requests stay fast and the tier recovers.

"Fast" is shown without a stopwatch on the fast path: what must not wait for Redis runs while a Redis call
is held open by the test (it could not finish otherwise), and what may wait is counted in connections and
timeouts, whose lower bounds no machine can beat.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from cache import EmbeddingCache, EmbeddingKey, MemoryTier, RedisTier

MakeKey = Callable[..., EmbeddingKey]
MakeTier = Callable[..., RedisTier]
TIMEOUT_S = 0.05  # make_tier's connect and read timeouts
WAIT_S = 30.0  # a bound on waiting for a condition, far past any machine's pace: reaching it fails the test


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


@contextmanager
def held_calls(tier: RedisTier, *names: str) -> Iterator[threading.Event]:
    """The tier's Redis client calls ``names`` block (once they are reached, ``entered`` is set) until the
    block exits; yields ``entered``."""
    entered, release = threading.Event(), threading.Event()
    client = tier._client
    for name in names:
        real = getattr(client, name)

        def held(*args, _real=real, **kw):
            entered.set()
            release.wait(2 * WAIT_S)
            return _real(*args, **kw)

        setattr(client, name, held)
    try:
        yield entered
    finally:
        release.set()


def in_time(fn: Callable[[], object]) -> object:
    """``fn()`` run on another thread; it must return within WAIT_S (it may not wait for a held call)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=WAIT_S)
    finally:
        pool.shutdown(wait=False)  # NOTE: not waiting: a call past the bound is still held


def test_refused_connections_fail_fast_and_open_the_breaker(
    make_tier: MakeTier, make_key: MakeKey, refused_port: int
) -> None:
    # Timeouts far longer than any machine needs to be refused: a call that waited one out would show.
    slow = 30.0
    tier = make_tier(
        f"redis://127.0.0.1:{refused_port}/0",
        failure_threshold=3,
        cooldown_s=60,
        timeout_s=slow,
        connect_timeout_s=slow,
        clock=FakeClock(),
    )
    results, elapsed = timed(lambda: [tier.get(make_key(i)) for i in range(50)])
    assert results == [None] * 50
    assert elapsed < slow
    stats = tier.stats()
    assert (stats["errors"], stats["short_circuited"], stats["misses"]) == (3, 47, 50)
    assert (stats["breaker_state"], stats["breaker_opens"]) == ("open", 1)


def test_a_hung_server_costs_at_most_threshold_timeouts(
    make_tier: MakeTier, make_key: MakeKey, black_hole: Any
) -> None:
    tier = make_tier(
        f"redis://127.0.0.1:{black_hole.port}/0", failure_threshold=3, cooldown_s=60, clock=FakeClock()
    )
    results, elapsed = timed(lambda: [tier.get(make_key(i)) for i in range(50)])
    assert results == [None] * 50
    # Three calls each wait out a timeout (proving the server hung rather than refused) ...
    assert elapsed >= 3 * TIMEOUT_S * 0.9
    # ... each on one connection, with no retry (redis-py's default retries would reconnect); the other 47
    # never reach the server.
    assert black_hole.connections() == 3
    stats = tier.stats()
    assert (stats["errors"], stats["short_circuited"], stats["breaker_state"]) == (3, 47, "open")


def test_puts_never_block_on_a_hung_server(make_tier: MakeTier, make_key: MakeKey, black_hole: Any) -> None:
    tier = make_tier(
        f"redis://127.0.0.1:{black_hole.port}/0", failure_threshold=3, max_pending_puts=8, clock=FakeClock()
    )
    value = torch.zeros(64, 256)
    with held_calls(tier, "set") as writing:
        in_time(lambda: tier.put(make_key(0), value))
        assert writing.wait(WAIT_S)  # the writer is inside its first SET, and stays there
        in_time(lambda: [tier.put(make_key(i), value) for i in range(1, 200)])
        stats = tier.stats()
        assert (stats["pending_puts"], stats["dropped_puts"]) == (1 + 8, 200 - 1 - 8)  # the queue is bounded
    # Let go, the writer meets the hung server: three timeouts open the breaker, the rest is dropped.
    assert tier.flush(timeout_s=WAIT_S)
    tier.close()
    assert tier._writer is not None and not tier._writer.is_alive()
    stats = tier.stats()
    assert (stats["puts"], stats["dropped_puts"], stats["pending_puts"]) == (0, 200, 0)
    assert (stats["errors"], stats["breaker_state"]) == (3, "open")


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


def test_l1_keeps_serving_while_l2_hangs(make_tier: MakeTier, make_key: MakeKey, black_hole: Any) -> None:
    l2 = make_tier(f"redis://127.0.0.1:{black_hole.port}/0")
    cache = EmbeddingCache(MemoryTier(1 << 20), l2)
    keys = [make_key(i) for i in range(20)]
    with held_calls(l2, "set", "mget") as in_redis:
        # Every L2 call blocks: the puts and the L1 hits can only return if none of them waits for one.
        in_time(lambda: [cache.put(k, torch.ones(8, 8)) for k in keys])
        assert in_redis.wait(WAIT_S)  # the writer did try Redis, and is held there
        hits = in_time(lambda: cache.get_many(keys))
        assert all(h is not None for h in hits)  # type: ignore[union-attr]
        stats = cache.stats()["redis"]
        assert stats["misses"] == stats["hits"] == 0, "L1 hits must not consult L2"
    # An L1 miss does ask L2, which times out: a miss, not an error for the caller.
    assert cache.get(make_key(99)) is None
    stats = cache.stats()["redis"]
    assert stats["misses"] == 1 and stats["errors"] >= 1


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
    short_circuited = tier.stats()["short_circuited"]
    assert [tier.get(make_key(1)) for _ in range(50)] == [None] * 50
    assert tier.stats()["short_circuited"] == short_circuited + 50
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
