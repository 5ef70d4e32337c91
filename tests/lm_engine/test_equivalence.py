"""Greedy output of the engine equals transformers' generate(), token for token (fp32, CPU), for both families
with a tower of ours: Qwen2-VL and Qwen2.5-VL (window attention; the mixed requests' patch grids include ones
that are not a multiple of its 8-patch window, and requests with two images)."""

from __future__ import annotations

import pytest

from lm_engine import LLM, SamplingParams, prefix_cache
from tests.support import HFOracle, image_part, make_image, mixed_requests, user
from tools.qwen2_vl_make import make_checkpoint

MAX_NEW = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# A fixed KV pool (512 blocks of 16 tokens hold every prompt of a batch and keep them cached) spares each
# engine the sizing warm-up, about 1 s of CPU; tests/lm_engine/test_kv_sizing.py covers the sizing.
POOL = 512


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ckpt(family, request):
    """The family's tiny checkpoint (session fixtures: built once, shared with the other modules)."""
    return request.getfixturevalue({"qwen2_vl": "tiny_ckpt", "qwen2_5_vl": "tiny25_ckpt"}[family])


@pytest.fixture(scope="module")
def oracle(family, request) -> HFOracle:
    return request.getfixturevalue({"qwen2_vl": "hf_oracle", "qwen2_5_vl": "hf_oracle25"}[family])


@pytest.fixture(scope="module")
def references(oracle):
    return [oracle.generate(conv, MAX_NEW) for conv in mixed_requests()]


def assert_matches(outs, refs):
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"request {i}: engine {out.token_ids} != transformers {ref}"


def test_mixed_batch_with_chunks_through_images(ckpt, references, oracle):
    # A 96-token budget cuts every image span above 96 placeholders across several prefill chunks.
    llm = LLM(
        str(ckpt),
        max_num_batched_tokens=96,
        block_size=16,
        num_kv_blocks=POOL,
        enable_prefix_caching=True,
    )
    convs = mixed_requests()
    for conv, out in zip(convs, llm.chat(convs, GREEDY)):
        assert out.prompt_token_ids == oracle.inputs(conv)["input_ids"][0].tolist()
    outs = llm.chat(convs, GREEDY)
    assert_matches(outs, references)
    # Some prompts really were cut through an image span.
    assert any(max(o.visual_tokens, default=0) > 96 for o in outs)

    # Second run: same batch, now served largely from the prefix cache.
    again = llm.chat(convs, GREEDY)
    assert_matches(again, references)
    assert sum(o.num_cached_tokens for o in again) > 0.5 * sum(len(o.prompt_token_ids) for o in again)
    llm.engine.check_integrity()


def test_shared_prefix_different_images(ckpt, oracle):
    """Same text, same image size, different pixels: each request must get its own image's answer."""
    system = {"role": "system", "content": "You are a careful assistant who looks closely at pictures. " * 3}
    convs = [
        [system, *user(image_part(make_image(224, 224, 100 + i)), "What is in the picture?")]
        for i in range(4)
    ]
    refs = [oracle.generate(c, MAX_NEW) for c in convs]
    assert len({tuple(r) for r in refs}) > 1, (
        "the images must lead to different answers for this test to bite"
    )
    llm = LLM(str(ckpt), max_num_batched_tokens=128, num_kv_blocks=POOL, enable_prefix_caching=True)
    # One after another (each later request finds the earlier ones' blocks cached) ...
    for i, (conv, ref) in enumerate(zip(convs, refs)):
        (out,) = llm.chat([conv], GREEDY)
        assert out.token_ids == ref
        assert (out.num_cached_tokens > 0) == (i > 0)  # the shared text prefix was reused
    # ... and all together.
    assert_matches(llm.chat(convs, GREEDY), refs)


def test_prefix_cache_without_image_identity_fails(ckpt, oracle, monkeypatch):
    """Negative control: a block hash that ignores image identity serves one image's KV to another."""
    monkeypatch.setattr(prefix_cache, "block_extra_keys", lambda images, start, end: ())
    convs = [user(image_part(make_image(224, 224, 200 + i)), "What is in the picture?") for i in range(3)]
    refs = [oracle.generate(c, MAX_NEW) for c in convs]
    llm = LLM(str(ckpt), max_num_batched_tokens=512, num_kv_blocks=POOL, enable_prefix_caching=True)
    llm.chat([convs[0]], GREEDY)
    outs = [llm.chat([c], GREEDY)[0] for c in convs[1:]]
    assert any(o.token_ids != r for o, r in zip(outs, refs[1:])), "the broken hash went unnoticed"


def test_preemption_by_recompute(ckpt, oracle):
    """Requests with images admitted into a pool too small for their decodes: growth forces preemption,
    and the recomputed requests still match transformers (with and without prefix caching)."""
    convs = [
        user(
            image_part(make_image(224, 168 + 56 * (i % 2), 300 + i)),
            f"Question {i}: " + "tell me more " * (i % 3),
        )
        if i % 4
        else user(f"Question {i}: " + "please tell me more about it " * (2 + i % 3))
        for i in range(8)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    refs = [oracle.generate(c, 40) for c in convs]
    for caching in (True, False):
        llm = LLM(str(ckpt), max_num_batched_tokens=256, num_kv_blocks=48, enable_prefix_caching=caching)
        # NOTE: encode every image first. Otherwise images that finish encoding late can let the
        # early requests finish before the late ones need blocks, and nothing is preempted.
        llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=1))
        before = llm.engine.scheduler.num_preemptions
        assert_matches(llm.chat(convs, params), refs)
        assert llm.engine.scheduler.num_preemptions > before
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_no_prefix_caching_matches(ckpt, references, backend):
    """Both CPU attention backends: plain torch (gather + SDPA) and the compiled decode kernel."""
    llm = LLM(
        str(ckpt),
        max_num_batched_tokens=2048,
        num_kv_blocks=POOL,
        enable_prefix_caching=False,
        attention_backend=backend,
    )
    assert llm.engine.runner.backend.name == backend
    assert_matches(llm.chat(mixed_requests(), GREEDY), references)


WIDE_IMAGE = make_image(280, 280, 11)  # 100 visual tokens


def test_wide_preset_with_chunks_through_images_and_a_prefix_hit(tmp_path):
    """The `wide` preset: head dim 128 (64 in the tower) and Qwen2-VL's M-RoPE sections and rope theta, where
    the tiny preset has 16. A 64-token budget cuts the image spans; the last request reuses the first's image
    blocks from the prefix cache."""
    ckpt = make_checkpoint(tmp_path / "wide", preset="wide", seed=0)
    convs = [
        user("Tell me a story about a lighthouse keeper and the sea, in three short sentences."),
        user(image_part(WIDE_IMAGE), "What is in this picture?"),
        user(
            "Look at this: ",
            image_part(make_image(336, 224, 12)),
            " and this: ",
            image_part(make_image(224, 168, 13)),
        ),
    ]
    again = user(image_part(WIDE_IMAGE), "Which colours are in it?")
    oracle = HFOracle(ckpt)
    refs = [oracle.generate(c, MAX_NEW) for c in [*convs, again]]
    assert len({tuple(r) for r in refs}) == len(refs), "the prompts must lead to different answers"
    with LLM(str(ckpt), max_num_batched_tokens=64, num_kv_blocks=128, enable_prefix_caching=True) as llm:
        assert llm.engine.model_config.hidden_size // llm.engine.model_config.num_attention_heads == 128
        outs = llm.chat(convs, GREEDY)
        assert_matches(outs, refs[:3])
        assert max(outs[1].visual_tokens) > 64
        (hit,) = llm.chat([again], GREEDY)
        assert hit.token_ids == refs[3]
        assert hit.num_cached_tokens > max(hit.visual_tokens)  # the image's KV came from the prefix cache
        llm.engine.check_integrity()
