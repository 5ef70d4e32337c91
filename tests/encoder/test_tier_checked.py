"""Embeddings that come back malformed, from Redis or from the encoder pool, are misses: the engine checks
each one against its key (dtype, one row per merged token of the grid, the model's row width, the level
count) before it caches or uses it, deletes a bad Redis entry and counts it, and encodes the image again, so
the request it belonged to gets the same answer as with a clean cache. The in-process path and the
encoder-tier path share the check.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry

from cache import EmbeddingKey, codec
from cache.metrics import EmbeddingCacheCollector
from lm_engine import LLM, SamplingParams
from tests.cache.test_cache_metrics import scrape
from tests.conftest import ENGINE_REDIS_URL
from tests.encoder.tier_support import FakePool, start_pool
from tests.support import image_part, make_image, redis_client, user

pytestmark = pytest.mark.timeout(1200)  # NOTE: a pool and several engines start here

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
REQUESTS = {
    kind: user(image_part(make_image(96 + 32 * i, 128, 501 + i)), "What is this?")
    for i, kind in enumerate(("dtype", "rows", "truncated", "levels"))
}


@pytest.fixture(scope="module")
def plain(tiny_ckpt):
    with LLM(str(tiny_ckpt), num_kv_blocks=128, embedding_cache_bytes=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def expected(plain):
    return {kind: o.token_ids for kind, o in zip(REQUESTS, plain.chat(list(REQUESTS.values()), GREEDY))}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_ckpt):
    p = start_pool(tmp_path_factory.mktemp("pool"), tiny_ckpt, "--workers", "1")
    yield p
    p.stop()


def shape_of(llm: LLM, key: EmbeddingKey) -> tuple[int, int, torch.dtype]:
    """The rows, row width and dtype of ``key``'s embedding, as the model reads it."""
    runner, merge = llm.engine.runner, llm.engine.model_config.spatial_merge_size
    rows = key.grid[0] * key.grid[1] * key.grid[2] // merge**2
    return rows, runner.vision.out_dim * (1 + runner.vision.levels), runner.dtype


def malformed(kind: str, key: EmbeddingKey, llm: LLM) -> bytes:
    rows, width, dtype = shape_of(llm, key)
    digest = key.digest()
    good = torch.zeros(rows, width, dtype=dtype)
    return {
        "dtype": lambda: codec.encode(digest, good.double()),
        "rows": lambda: codec.encode(digest, torch.zeros(rows + 1, width, dtype=dtype)),
        "truncated": lambda: codec.encode(digest, good)[:-3],
        "levels": lambda: codec.encode(digest, torch.zeros(rows, 2 * width, dtype=dtype), levels=1),
    }[kind]()


def key_of(llm: LLM, messages) -> EmbeddingKey:
    return llm.engine.process_chat(messages).images[0].key


@pytest.mark.redis
@pytest.mark.parametrize("path", ["in-process", "encoder-tier"])
def test_malformed_redis_entries_are_deleted_misses_and_the_answer_is_right(
    path, pool, expected, tiny_ckpt, redis_db_url
):
    prefix = f"vlmserve-test-checked-{uuid.uuid4().hex}:"
    kw = dict(redis_url=redis_db_url, redis_key_prefix=prefix)
    if path == "encoder-tier":
        kw["encoder_url"] = f"unix://{pool.socket_path}"
    r = redis_client(ENGINE_REDIS_URL)
    with LLM(str(tiny_ckpt), num_kv_blocks=128, embedding_cache_bytes=0, **kw) as llm:
        registry = CollectorRegistry()
        registry.register(EmbeddingCacheCollector(llm.engine.embedding_cache))
        keys = {kind: key_of(llm, messages) for kind, messages in REQUESTS.items()}
        names = {kind: llm.engine.embedding_cache.l2.redis_key(key) for kind, key in keys.items()}
        for kind, key in keys.items():
            r.set(names[kind], malformed(kind, key, llm))
        got = {kind: o.token_ids for kind, o in zip(REQUESTS, llm.chat(list(REQUESTS.values()), GREEDY))}
        assert llm.engine.embedding_cache.l2.flush()
        stats = llm.engine.embedding_cache.stats()["redis"]
        m = scrape(registry)
        want = {kind: shape_of(llm, key) for kind, key in keys.items()}
        if path == "encoder-tier":
            assert llm.engine.vision.remote.fallbacks == {} and llm.engine.vision.stats.images == 0
    assert got == expected  # each image encoded again, every request answered as with a clean cache
    assert stats["invalid"] == len(REQUESTS) and stats["hits"] == 0, stats
    assert m[("vlmserve_embedding_cache_invalid_total", (("tier", "redis"),))] == len(REQUESTS)
    for kind, key in keys.items():
        stored = r.get(names[kind])  # deleted; since then, perhaps the right entry written back
        if stored is not None:
            emb = codec.decode(key.digest(), stored, key.levels)
            rows, width, dtype = want[kind]
            assert emb.shape == (rows, width) and emb.dtype == dtype, kind
    r.close()


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_a_malformed_entry_from_the_pool_is_encoded_again(kind, plain, expected, tiny_ckpt, tmp_path):
    """A pool (or whatever answers at its address) that ships an entry not fitting the key costs a local
    encode, never the step."""
    fake = FakePool(
        tmp_path,
        plain.engine.preprocess_config.fingerprint(),
        plain.engine.processor.model_fingerprint,
        lambda key: malformed(kind, key, plain),
    )
    try:
        with LLM(str(tiny_ckpt), num_kv_blocks=128, embedding_cache_bytes=0, encoder_url=fake.url) as llm:
            out = llm.chat([REQUESTS[kind]], GREEDY)[0].token_ids
            vision = llm.engine.vision
            assert fake.served == 1
            assert vision.remote.fallbacks == {"invalid": 1} and vision.stats.images == 1
    finally:
        fake.close()
    assert out == expected[kind]


@pytest.mark.redis
def test_a_malformed_entry_the_pool_says_is_in_redis_is_deleted_and_encoded_again(
    plain, expected, tiny_ckpt, tmp_path, redis_db_url
):
    prefix = f"vlmserve-test-checked-{uuid.uuid4().hex}:"
    r = redis_client(ENGINE_REDIS_URL)
    fake = FakePool(
        tmp_path,
        plain.engine.preprocess_config.fingerprint(),
        plain.engine.processor.model_fingerprint,
        lambda key: malformed("rows", key, plain),
        redis=r,
        prefix=prefix,
    )
    kw = dict(redis_url=redis_db_url, redis_key_prefix=prefix, encoder_url=fake.url)
    try:
        with LLM(str(tiny_ckpt), num_kv_blocks=128, embedding_cache_bytes=0, **kw) as llm:
            out = llm.chat([REQUESTS["rows"]], GREEDY)[0].token_ids
            vision = llm.engine.vision
            assert vision._ship == "redis" and fake.served == 1
            assert vision.remote.fallbacks == {"lost": 1} and vision.stats.images == 1
            assert llm.engine.embedding_cache.l2.flush()
            assert llm.engine.embedding_cache.stats()["redis"]["invalid"] == 1
    finally:
        fake.close()
        r.close()
    assert out == expected["rows"]
