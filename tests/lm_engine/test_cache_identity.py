"""What may share cached work, end to end on the tiny checkpoint: images whose bytes collide under XXH3 share
nothing under the default hash, and requests of different cache salts share no prefix blocks and no image
embeddings. Greedy output equals transformers' generate() throughout: identity never changes an answer."""

from __future__ import annotations

import itertools

import pytest
import xxhash

from lm_engine import LLM, SamplingParams
from tests.support import image_part, make_image, user
from tests.xxh3_collision import colliding_bmps

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
POOL = 256
QUESTION = "What is in the picture?"
_ids = itertools.count()


def run(llm: LLM, conv: list[dict], cache_salt: str = ""):
    """One request through the engine alone, as the server sends it: the prompt built with its salt, then
    queued with the same salt."""
    engine = llm.engine
    rid = f"identity-{next(_ids)}"
    engine.add_request(rid, engine.process_chat(conv, cache_salt=cache_salt), GREEDY, cache_salt=cache_salt)
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


@pytest.fixture(scope="module")
def salt_convs():
    return [
        user("Tell me about the sea and the lighthouse keeper who lives by it, in a few sentences."),
        user(image_part(make_image(224, 224, 31)), QUESTION),
    ]


@pytest.fixture(scope="module")
def salt_refs(salt_convs, hf_oracle):
    return [hf_oracle.generate(c, MAX_NEW) for c in salt_convs]


@pytest.mark.parametrize("which", ["text", "image"])
def test_salts_share_no_cached_tokens(tiny_ckpt, salt_convs, salt_refs, which):
    conv, ref = {"text": (salt_convs[0], salt_refs[0]), "image": (salt_convs[1], salt_refs[1])}[which]
    llm = LLM(str(tiny_ckpt), num_kv_blocks=POOL)
    cached = {}
    for step, salt in enumerate(["tenant-a", "tenant-b", "tenant-a", "", "tenant-b", ""]):
        out = run(llm, conv, salt)
        assert out.token_ids == ref, f"step {step} (salt {salt!r}): the salt changed the answer"
        cached[step] = out.num_cached_tokens
    assert cached[0] == 0  # a fresh engine
    assert cached[1] == 0  # another salt: not one block of tenant-a's
    assert cached[2] > 0  # the same salt again: its own blocks
    assert cached[3] == 0  # no salt: not a salted request's blocks
    assert cached[4] > 0 and cached[5] > 0  # each finds its own
    if which == "image":
        # One embedding per salt (and one unsalted): an embedding hit would show as a faster first token.
        keys = {
            llm.engine.process_chat(conv, cache_salt=s).images[0].key for s in ("tenant-a", "tenant-b", "")
        }
        assert len(keys) == 3 and len({k.image_hash for k in keys}) == 1
        assert all(llm.engine.embedding_cache.contains(k) for k in keys)
        assert len(llm.engine.embedding_cache.l1) == 3
    llm.close()


def test_a_prompt_keyed_under_another_salt_is_refused(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), num_kv_blocks=POOL)
    prompt = llm.engine.process_chat(
        user(image_part(make_image(56, 56, 32)), QUESTION), cache_salt="tenant-a"
    )
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request("mismatch", prompt, GREEDY, cache_salt="tenant-b")
    assert not llm.engine.has_unfinished()
    llm.close()
