"""What may share cached work, end to end on the tiny checkpoint: images whose bytes collide under XXH3 share
nothing under the default hash. Greedy output equals transformers' generate() throughout."""

from __future__ import annotations

import itertools

import pytest
import xxhash

from lm_engine import LLM, SamplingParams
from tests.support import image_part, user
from tests.xxh3_collision import colliding_bmps

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
POOL = 256
QUESTION = "What is in the picture?"
_ids = itertools.count()


def run(llm: LLM, conv: list[dict]):
    """One request through the engine alone, as the server sends it: the prompt built, then queued."""
    engine = llm.engine
    rid = f"identity-{next(_ids)}"
    engine.add_request(rid, engine.process_chat(conv), GREEDY)
    done = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                done = out
    engine.check_integrity()
    assert done is not None and done.error is None
    return done


@pytest.fixture(scope="module")
def bmps() -> tuple[bytes, bytes]:
    a, b = colliding_bmps(128, 176, seed=7)
    assert a != b and a[:54] == b[:54]  # one header, different pixels
    assert xxhash.xxh3_128_digest(a) == xxhash.xxh3_128_digest(b)
    assert xxhash.xxh3_64_digest(a) == xxhash.xxh3_64_digest(b)
    return a, b


@pytest.fixture(scope="module")
def collision_refs(bmps, hf_oracle):
    refs = [hf_oracle.generate(user(image_part(x), QUESTION), MAX_NEW) for x in bmps]
    assert refs[0] != refs[1], "the two pictures must get different answers for this test to bite"
    return refs


def _image_span(llm: LLM, conv: list[dict]) -> tuple[int, int]:
    (image,) = llm.engine.process_chat(conv).images
    return image.offset, image.end


def test_colliding_images_get_their_own_embeddings_and_kv(tiny_ckpt, bmps, collision_refs):
    """Under the default (cryptographic) hash: the second picture is not the first, in the embedding cache or
    in the prefix cache; each gets its own answer."""
    llm = LLM(str(tiny_ckpt), num_kv_blocks=POOL)
    assert llm.engine.config.hash_algorithm == "blake3"
    convs = [user(image_part(x), QUESTION) for x in bmps]
    first, second = run(llm, convs[0]), run(llm, convs[1])
    assert first.token_ids == collision_refs[0] and second.token_ids == collision_refs[1]
    offset, _ = _image_span(llm, convs[1])
    assert second.num_cached_tokens <= offset  # at most the text before the image: none of its span
    keys = [llm.engine.process_chat(c).images[0].key for c in convs]
    assert keys[0] != keys[1] and keys[0].image_hash != keys[1].image_hash
    assert all(llm.engine.embedding_cache.contains(k) for k in keys)
    assert len(llm.engine.embedding_cache.l1) == 2
    llm.close()


def test_colliding_images_alias_under_the_xxh3_opt_in(tiny_ckpt, bmps, collision_refs):
    """The risk ``--hash-algorithm xxh3`` takes: the second picture is answered from the first one's embedding
    and KV blocks (its whole prompt served from the prefix cache)."""
    llm = LLM(str(tiny_ckpt), num_kv_blocks=POOL, hash_algorithm="xxh3")
    convs = [user(image_part(x), QUESTION) for x in bmps]
    first, second = run(llm, convs[0]), run(llm, convs[1])
    assert first.token_ids == collision_refs[0]
    assert second.token_ids == collision_refs[0] != collision_refs[1]  # the first picture's answer
    _, end = _image_span(llm, convs[1])
    assert second.num_cached_tokens >= end
    assert len(llm.engine.embedding_cache.l1) == 1
    llm.close()
