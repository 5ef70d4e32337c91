"""Qwen3-VL: the generated checkpoint loads in transformers, and our engine's greedy ids equal its generate()."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from cache import codec
from encoder.models import Qwen3VisionTower
from lm_engine import LLM, SamplingParams, model_runner
from lm_engine.models import qwen3_vl
from lm_engine.models.qwen2_vl import MRotaryEmbedding
from lm_engine.step_inputs import build_step
from lm_engine.visual_budget import default_ladder
from tests.support import HFOracle, image_part, make_image, mixed_requests, user
from tools.qwen3_vl_make import PRESETS, param_count

MAX_NEW = 20


@pytest.fixture(scope="module")
def oracle(qwen3_tiny_ckpt: Path) -> HFOracle:
    return HFOracle(qwen3_tiny_ckpt)


# -- the generated checkpoint ---------------------------------------------------------------------------
def test_checkpoint_loads_in_transformers(qwen3_tiny_ckpt: Path, oracle: HFOracle) -> None:
    model, info = AutoModelForImageTextToText.from_pretrained(
        qwen3_tiny_ckpt, local_files_only=True, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and model.dtype == torch.float32
    assert type(oracle.processor).__name__ == "Qwen3VLProcessor"
    text, vision = model.config.text_config, model.config.vision_config
    p = PRESETS["tiny"]
    assert text.head_dim == p.head_dim != text.hidden_size // text.num_attention_heads
    assert text.rope_parameters["mrope_interleaved"] is True
    assert text.rope_parameters["mrope_section"] == list(p.mrope_section)
    assert vision.patch_size == 16 and list(vision.deepstack_visual_indexes) == list(
        p.deepstack_visual_indexes
    )
    pre = json.loads((qwen3_tiny_ckpt / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == 16 and pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]
    # The processor's placeholders: 32 px per merged token.
    inputs = oracle.inputs(user(image_part(make_image(224, 160, 1)), "Hi"))
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 14]]  # (t, h, w); the image is 224 wide
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 14 * 10 // 4


def test_small_preset_is_about_100m_parameters() -> None:
    assert 80e6 < param_count("small") < 150e6


def test_outputs_vary_with_prompt_and_image(oracle: HFOracle) -> None:
    """Random weights that ignore the image or the prompt would make the equivalence tests prove nothing."""
    texts = [oracle.generate(user(t), MAX_NEW) for t in ("Hi", "Tell me a story", "What is the time?")]
    assert len({tuple(t) for t in texts}) == 3
    images = [oracle.generate(user(image_part(make_image(224, 224, s)), "What?"), MAX_NEW) for s in (1, 2, 3)]
    assert len({tuple(t) for t in images}) == 3


# -- equivalence: greedy ids equal transformers' generate() (float32, CPU) ---------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def references(oracle: HFOracle) -> list[list[int]]:
    return [oracle.generate(conv, MAX_NEW) for conv in mixed_requests()]


def assert_matches(outs, refs) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"request {i}: engine {out.token_ids} != transformers {ref}"


def image_spans(ids: list[int], pad: int) -> list[tuple[int, int]]:
    """[start, end) of every run of image placeholders."""
    spans: list[tuple[int, int]] = []
    for i, tok in enumerate(ids):
        if tok == pad:
            if spans and spans[-1][1] == i:
                spans[-1] = (spans[-1][0], i + 1)
            else:
                spans.append((i, i + 1))
    return spans


@pytest.fixture
def chunk_log(monkeypatch) -> list[tuple[str, int, int]]:
    """(request id, first token, end) of every prefill chunk the engine runs."""
    log: list[tuple[str, int, int]] = []

    def spy(sched, embeddings, block_size, device):
        for c in sched.chunks:
            if c.num_tokens > 1:
                start = c.seq.num_computed_tokens
                log.append((c.seq.request_id, start, start + c.num_tokens))
        return build_step(sched, embeddings, block_size, device)

    monkeypatch.setattr(model_runner, "build_step", spy)
    return log


def test_mixed_batch_with_chunks_through_images(qwen3_tiny_ckpt, references, oracle):
    llm = LLM(str(qwen3_tiny_ckpt), max_num_batched_tokens=96, block_size=16, enable_prefix_caching=True)
    convs = mixed_requests()
    outs = llm.chat(convs, GREEDY)
    for conv, out in zip(convs, outs):
        assert out.prompt_token_ids == oracle.inputs(conv)["input_ids"][0].tolist()
    assert_matches(outs, references)
    assert any(max(o.visual_tokens, default=0) > 96 for o in outs)  # spans cut across chunks
    again = llm.chat(convs, GREEDY)  # now largely from the prefix cache
    assert_matches(again, references)
    assert sum(o.num_cached_tokens for o in again) > 0.5 * sum(len(o.prompt_token_ids) for o in again)
    llm.engine.check_integrity()


def test_two_images_with_a_chunk_boundary_inside_each(qwen3_tiny_ckpt, oracle, chunk_log):
    conv = user(image_part(make_image(320, 256, 21)), "First.", image_part(make_image(288, 224, 22)), "Both?")
    ids = oracle.inputs(conv)["input_ids"][0].tolist()
    spans = image_spans(ids, json.loads((qwen3_tiny_ckpt / "config.json").read_text())["image_token_id"])
    assert len(spans) == 2
    budget = next(
        b for b in range(24, 120) if all(any(a < k * b < e for k in range(1, 20)) for a, e in spans)
    )
    ref = oracle.generate(conv, MAX_NEW)
    llm = LLM(str(qwen3_tiny_ckpt), max_num_batched_tokens=budget, enable_prefix_caching=False)
    (out,) = llm.chat([conv], GREEDY)
    assert out.token_ids == ref
    cuts = {end for _, _, end in chunk_log if end < len(ids)}
    assert all(any(a < c < e for c in cuts) for a, e in spans), (cuts, spans)


def test_prefix_cache_hit_starting_inside_an_image(qwen3_tiny_ckpt, oracle, chunk_log):
    """A cached prefix that ends inside the image: the rest of the image's rows (every level) from there."""
    pad = json.loads((qwen3_tiny_ckpt / "config.json").read_text())["image_token_id"]
    for width in range(96, 640, 32):
        conv = user("Look:", image_part(make_image(width, 160, 23)))
        ids = oracle.inputs(conv)["input_ids"][0].tolist()
        ((a, e),) = image_spans(ids, pad)
        hit = (len(ids) - 1) // 16 * 16
        if a < hit < e:
            break
    else:
        pytest.fail("no image width puts the cache boundary inside the image")
    ref = oracle.generate(conv, MAX_NEW)
    llm = LLM(str(qwen3_tiny_ckpt), max_num_batched_tokens=64, block_size=16, enable_prefix_caching=True)
    assert llm.chat([conv], GREEDY)[0].token_ids == ref
    (out,) = llm.chat([conv], GREEDY)
    assert out.num_cached_tokens == hit and out.token_ids == ref
    assert chunk_log[-1][1:] == (hit, len(ids))  # the second run computed from inside the image on


def test_same_text_different_images(qwen3_tiny_ckpt, oracle):
    system = {"role": "system", "content": "You are a careful assistant who looks closely at pictures. " * 3}
    convs = [[system, *user(image_part(make_image(224, 224, 100 + i)), "What is in it?")] for i in range(4)]
    refs = [oracle.generate(c, MAX_NEW) for c in convs]
    assert len({tuple(r) for r in refs}) > 1
    llm = LLM(str(qwen3_tiny_ckpt), max_num_batched_tokens=128, enable_prefix_caching=True)
    for i, (conv, ref) in enumerate(zip(convs, refs)):
        (out,) = llm.chat([conv], GREEDY)
        assert out.token_ids == ref and (out.num_cached_tokens > 0) == (i > 0)
    assert_matches(llm.chat(convs, GREEDY), refs)


def test_preemption_by_recompute(qwen3_tiny_ckpt, oracle):
    convs = [
        user(image_part(make_image(224, 160 + 64 * (i % 2), 300 + i)), f"Question {i}: " + "more " * (i % 3))
        if i % 4
        else user(f"Question {i}: " + "please tell me more about it " * (2 + i % 3))
        for i in range(8)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    refs = [oracle.generate(c, 40) for c in convs]
    for caching in (True, False):
        llm = LLM(
            str(qwen3_tiny_ckpt), max_num_batched_tokens=256, num_kv_blocks=40, enable_prefix_caching=caching
        )
        llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=1))  # every image encoded first
        before = llm.engine.scheduler.num_preemptions
        assert_matches(llm.chat(convs, params), refs)
        assert llm.engine.scheduler.num_preemptions > before
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_no_prefix_caching_matches(qwen3_tiny_ckpt, references, backend):
    """Both CPU attention backends: plain torch and the compiled decode kernel (head_dim 32)."""
    llm = LLM(
        str(qwen3_tiny_ckpt),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        attention_backend=backend,
    )
    assert llm.engine.runner.backend.name == backend
    assert_matches(llm.chat(mixed_requests(), GREEDY), references)


# -- negative controls: each Qwen3-VL rule changes the answers ------------------------------------------------
IMAGE_CONVS = [c for c in mixed_requests() if any(p.get("type") == "image" for p in c[-1]["content"][:1])]


@pytest.mark.parametrize("broken", ["no_deepstack", "contiguous_mrope"])
def test_each_rule_is_needed(qwen3_tiny_ckpt, oracle, monkeypatch, broken):
    if broken == "no_deepstack":
        forward = Qwen3VisionTower.forward

        def without_levels(self, pixels, grid_thw):
            rows = forward(self, pixels, grid_thw)
            rows[:, self.out_dim :] = 0
            return rows

        monkeypatch.setattr(Qwen3VisionTower, "forward", without_levels)
    else:
        monkeypatch.setattr(qwen3_vl, "InterleavedMRotary", MRotaryEmbedding)
    refs = [oracle.generate(c, MAX_NEW) for c in IMAGE_CONVS]
    llm = LLM(str(qwen3_tiny_ckpt), max_num_batched_tokens=512, enable_prefix_caching=False)
    outs = llm.chat(IMAGE_CONVS, GREEDY)
    assert any(o.token_ids != r for o, r in zip(outs, refs)), f"{broken} went unnoticed"


# -- the embedding cache: one entry holds every level, in one versioned format ---------------------------------
def _image_conv(seed: int) -> list[dict]:
    return user(image_part(make_image(224, 192, seed)), "What is in it?")


def test_memory_entry_without_its_levels_is_not_used(qwen3_tiny_ckpt, oracle):
    """An L1 entry of the wrong layout under the right key (main rows only, or one level of two) is a miss."""
    conv = _image_conv(40)
    ref = oracle.generate(conv, MAX_NEW)
    llm = LLM(str(qwen3_tiny_ckpt), enable_prefix_caching=False)
    key = llm.engine.process_chat(conv).images[0].key
    hidden, rows = PRESETS["tiny"].text.hidden_size, 7 * 6
    assert key.levels == 2
    for width in (hidden, 2 * hidden):
        llm.engine.embedding_cache.l1.put(key, torch.randn(rows, width))
        encoded = llm.engine.vision.stats.images
        assert llm.chat([conv], GREEDY)[0].token_ids == ref
        assert llm.engine.vision.stats.images == encoded + 1  # encoded again, not read from the bad entry
    # The right entry (written by that encoding) is a hit.
    encoded = llm.engine.vision.stats.images
    assert llm.chat([conv], GREEDY)[0].token_ids == ref and llm.engine.vision.stats.images == encoded


def test_redis_entry_of_another_version_or_level_count_is_not_used(qwen3_tiny_ckpt, oracle, redis_db_url):
    """Entries with the right shape and the wrong values: a version-1 entry and one declaring 0 levels.
    Read, they would change the answer; refused, they are recomputed."""
    import redis

    from tests.cache.test_levels import version_1_entry

    prefix = "vlmserve-test-qwen3-"
    client = redis.Redis.from_url(redis_db_url)
    writers = {
        "version-1": version_1_entry,
        "no-levels": lambda digest, t: codec.encode(digest, t, levels=0),
    }
    for seed, (name, write) in enumerate(writers.items(), start=41):
        conv = _image_conv(seed)
        ref = oracle.generate(conv, MAX_NEW)
        llm = LLM(
            str(qwen3_tiny_ckpt), enable_prefix_caching=False, redis_url=redis_db_url, redis_key_prefix=prefix
        )
        key = llm.engine.process_chat(conv).images[0].key
        wrong = torch.randn(7 * 6, 3 * PRESETS["tiny"].text.hidden_size) * 3
        client.set(f"{prefix}emb:{key.digest()}", write(key.digest(), wrong))
        assert llm.chat([conv], GREEDY)[0].token_ids == ref, name
        assert llm.engine.embedding_cache.l2.stats()["corrupt"] == 1, name
        assert llm.engine.vision.stats.images == 1, name
        llm.engine.embedding_cache.l2.flush()
        # What the engine wrote back is the current format, and a fresh engine reads it.
        again = LLM(
            str(qwen3_tiny_ckpt), enable_prefix_caching=False, redis_url=redis_db_url, redis_key_prefix=prefix
        )
        assert again.chat([conv], GREEDY)[0].token_ids == ref and again.engine.vision.stats.images == 0
    client.close()


# -- the adaptive visual budget on 32-px tokens ----------------------------------------------------------------
def test_visual_budget_ladder_follows_32px_tokens(qwen3_tiny_ckpt, oracle):
    """Each ladder level is a whole number of 32-px tokens, and an image planned at a level gets the grid
    transformers' own processor gives at that max_pixels."""
    assert default_ladder(999_000, 4096, 32) == [999_000, 498_688, 248_832, 4096]  # 487, 243 tokens
    llm = LLM(str(qwen3_tiny_ckpt), enable_prefix_caching=False)
    ladder = llm.engine.load.visual_budget.ladder
    assert len(ladder) == 4 and all(v % (32 * 32) == 0 for v in ladder[1:])
    image = make_image(700, 500, 50)
    processor = oracle.processor.image_processor
    for level, max_pixels in enumerate(ladder):
        item, _ = llm.engine.processor.process_image(image, max_pixels)
        size = {"shortest_edge": processor.size["shortest_edge"], "longest_edge": max_pixels}
        ref = processor(images=[Image.open(io.BytesIO(image))], size=size, return_tensors="pt")
        assert list(item.key.grid) == ref["image_grid_thw"][0].tolist(), level
        assert item.length == int(ref["image_grid_thw"][0].prod()) // 4
