"""The encoder pool when Redis hangs or goes away: engines on the same host keep getting their embeddings
through shared memory, the pool's circuit breaker shows in its stats, and an engine elsewhere (embeddings
through Redis) is told at once and falls back as configured: a local encode or a 503 with Retry-After.

Redis is reached through a proxy the tests stall or close (tests.support.RedisProxy); the machine's Redis
server is never stopped. The pool's Redis timeout is long (600 s), so a stalled write holds its thread for
as long as the test says, whatever the machine's speed.
"""

from __future__ import annotations

import pytest
import torch

from preprocess import PreprocessConfig
from tests.conftest import ENGINE_REDIS_URL
from tests.encoder.test_tier_client import app, idle_metrics, image_chat
from tests.encoder.test_tier_pool import encode_here
from tests.encoder.tier_support import RawEngine, assert_fell_back, start_pool
from tests.support import RedisProxy, make_image, redis_client

# NOTE: a pool and three engines start here; on a crowded 2-core machine that can pass the default 300 s.
pytestmark = pytest.mark.timeout(1200)

REDIS_DB = 14  # ENGINE_REDIS_URL's
PREFIX = "vlmserve-test-enc-down:"
HANG_GUARD_S = 120.0  # a bound against hanging, not a pace


@pytest.fixture(scope="module")
def proxy():
    redis_client(ENGINE_REDIS_URL).close()  # skip (or fail on CI) without the test Redis
    p = RedisProxy()
    yield p
    p.close()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_ckpt, proxy):
    extra = ("--redis-url", proxy.url(REDIS_DB), "--redis-key-prefix", PREFIX, "--redis-timeout-s", "600")
    p = start_pool(
        tmp_path_factory.mktemp("pool"), tiny_ckpt, "--workers", "1", *extra, "--redis-ttl-s", "60"
    )
    yield p
    proxy.resume()
    p.stop()


@pytest.fixture(scope="module")
def inproc(tiny_ckpt):
    from lm_engine import LLM

    with LLM(str(tiny_ckpt), num_kv_blocks=32, embedding_cache_bytes=0) as llm:
        yield llm


@pytest.fixture
def redis_gone(proxy):
    proxy.close()  # idempotent: Redis stays gone for the rest of the module


def engines(pool) -> tuple[RawEngine, RawEngine]:
    """One engine on this host (shared memory) and one standing for an engine elsewhere (through Redis)."""
    here, there = RawEngine(pool.socket_path), RawEngine(pool.socket_path, ship="redis")
    assert (here.hello["ship"], there.hello["ship"]) == ("shm", "redis")
    for eng in (here, there):
        eng.sock.settimeout(HANG_GUARD_S)
    return here, there


def test_a_hanging_redis_holds_no_same_host_engine(pool, proxy, inproc, redis_db_url, tiny_ckpt):
    cfg = PreprocessConfig.from_checkpoint(tiny_ckpt)
    far_image, near_image = make_image(224, 160, 301, "JPEG"), make_image(200, 200, 302)
    here, there = engines(pool)
    with here, there:
        far, near = there.key(far_image, cfg), here.key(near_image, cfg)
        proxy.stall()
        try:
            there.encode(1, far, far_image)
            assert proxy.held.wait(HANG_GUARD_S), "the pool never wrote to Redis"
            # The pool's Redis write hangs (until the test resumes it); same-host shipping must not wait.
            here.encode(2, near, near_image)
            rid, emb, header = here.result({2: near})
            assert rid == 2 and header["via"] == "shm" and proxy.held.is_set()
            torch.testing.assert_close(emb, encode_here(inproc, near_image), rtol=1e-5, atol=1e-5)
        finally:
            proxy.resume()
        rid, _, header = there.result({1: far})
        assert rid == 1 and header["via"] == "redis", header
    stored = redis_client(ENGINE_REDIS_URL).get(f"{PREFIX}emb:{far.digest()}")
    from cache import codec

    torch.testing.assert_close(
        codec.decode(far.digest(), stored), encode_here(inproc, far_image), rtol=1e-5, atol=1e-5
    )


def test_redis_gone_same_host_shipping_continues_and_the_breaker_shows(pool, inproc, redis_gone, tiny_ckpt):
    cfg = PreprocessConfig.from_checkpoint(tiny_ckpt)
    images = [make_image(160 + 32 * i, 128, 310 + i, "JPEG") for i in range(4)]
    before = pool.stats()
    here, there = engines(pool)
    with here, there:
        for i, data in enumerate(images):
            key = here.key(data, cfg)
            there.encode(i, key, data)  # the same key from both: encoded once, shipped two ways
            here.encode(i, key, data)
            rid, emb, header = here.result({i: key})
            assert rid == i and header["via"] == "shm", header
            torch.testing.assert_close(emb, encode_here(inproc, data), rtol=1e-5, atol=1e-5)
            rid, emb, header = there.result({i: key})
            assert rid == i and emb is None and header["kind"] == "ship", header  # told at once, no hang
    after = pool.wait_for(lambda s: s["redis_queue"] == 0 and s["keys_in_flight"] == 0, what="drained")
    assert after["ship_failures"] - before["ship_failures"] == len(images)
    assert after["images_encoded"] - before["images_encoded"] == len(images)
    assert after["shipped"]["shm"] - before["shipped"].get("shm", 0) == len(images)
    assert after["shipped"].get("redis", 0) == before["shipped"].get("redis", 0)
    redis = after["redis"]
    # Three failed writes open the breaker; the fourth is not even tried.
    assert redis["breaker_state"] == "open" and redis["breaker_opens"] >= 1, redis
    assert redis["errors"] >= 3 and redis["short_circuited"] + redis["dropped_puts"] >= 1, redis
    assert after["waiting"] == 0 and after["pipeline_pending"] == 0


@pytest.mark.parametrize("fallback", ["local", "fail"])
def test_an_engine_elsewhere_falls_back_as_configured(
    fallback, pool, proxy, redis_gone, tiny_ckpt, monkeypatch
):
    chat = image_chat(320 + (fallback == "fail"))
    with app(tiny_ckpt) as plain:
        want = plain.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    monkeypatch.setattr("encoder.tier.client.host_id", lambda: "another-host")  # embeddings through Redis
    engine_kw = dict(
        encoder_url=pool.tcp_url,
        encoder_fallback=fallback,
        encoder_timeout_s=600,  # the answer must come from the pool's word, not the deadline
        redis_url=proxy.url(REDIS_DB),
        redis_key_prefix=PREFIX,
    )
    with app(tiny_ckpt, **engine_kw) as client:
        resp = client.post("/v1/chat/completions", json=chat)
        assert client.app.state.engine.engine.vision._ship == "redis"
        assert_fell_back(resp, fallback, want)
        m = idle_metrics(client)
        assert m["vlmserve_encoder_remote_fallbacks_total{reason=ship_failed}"] == 1
        assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
        # The engine's own Redis tier (gone too) shows its breaker in /metrics.
        assert m["vlmserve_embedding_cache_errors_total{tier=redis}"] >= 1
        assert sum(v for k, v in m.items() if k.startswith("vlmserve_embedding_cache_breaker_state")) == 1
