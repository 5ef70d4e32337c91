"""The engine under load: a burst lowers the visual budget and it recovers; shedding; fairness."""

from __future__ import annotations

import time

import pytest

from lm_engine import EngineConfig, EngineOverloaded, LLMEngine, SamplingParams
from tests.support import image_part, make_image, user

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def adaptive_engine(tiny_ckpt, **kw) -> LLMEngine:
    cfg = dict(
        model=str(tiny_ckpt),
        max_num_batched_tokens=64,
        visual_budget="adaptive",
        budget_dwell_s=0.15,
        ttft_slo_ms=300.0,
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def drain(engine: LLMEngine, outputs: dict) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out


def test_burst_lowers_level_and_it_returns_to_full(tiny_ckpt):
    # A ladder whose every level changes a 448×448 image's grid.
    engine = adaptive_engine(tiny_ckpt, visual_ladder=(448 * 448, 224 * 448, 224 * 224, 56 * 56))
    images = [make_image(448, 448, s) for s in range(40)]
    outputs: dict = {}
    # A burst: new requests keep arriving faster than 64 tokens/step can prefill them.
    shed = 0
    for i, img in enumerate(images):
        try:
            engine.add_request(f"b{i}", engine.process_chat(user(image_part(img), "what?")), PARAMS)
        except EngineOverloaded:
            shed += 1  # admission control may refuse at the bottom of the ladder; that is allowed
        for _ in range(2):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    drain(engine, outputs)
    served = sorted(outputs, key=lambda r: int(r[1:]))
    assert len(served) + shed == len(images) and len(served) > len(images) // 2
    levels = [outputs[r].visual_levels[0] for r in served]
    assert levels[0] == 0 and max(levels) > 0, levels
    tokens = [outputs[r].visual_tokens[0] for r in served]
    assert min(tokens) < tokens[0]  # lowered levels really mean fewer visual tokens
    # After the burst the level climbs back: a quiet spell, then a request gets full resolution.
    time.sleep(4 * 0.15 * (engine.visual_budget.lowest + 1))
    engine.add_request("after", engine.process_chat(user(image_part(images[0]), "what?")), PARAMS)
    drain(engine, outputs)
    assert outputs["after"].visual_levels == [0]
    assert engine.visual_budget.level == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_detail_low_and_high_ignore_the_controller(tiny_ckpt):
    engine = adaptive_engine(tiny_ckpt)
    engine.visual_budget.level = 2
    img = make_image(1024, 1024, 1)  # above the full budget, so every level changes its grid
    conv = lambda detail: user({"type": "image", "image": img, "detail": detail}, "?")  # noqa: E731
    low, auto, high = (engine.process_chat(conv(d)) for d in ("low", "auto", "high"))
    ladder = engine.visual_budget.ladder
    assert [i.max_pixels for p in (low, auto, high) for i in p.images] == [ladder[-1], ladder[2], ladder[0]]
    assert low.images[0].length < auto.images[0].length < high.images[0].length
    with pytest.raises(ValueError):
        engine.process_chat(conv("ultra"))
    engine.close()


def test_saturated_engine_sheds_new_work_but_keeps_admitted(tiny_ckpt):
    engine = adaptive_engine(tiny_ckpt, max_queued_requests=6)
    for i in range(6):
        engine.add_request(f"q{i}", user(f"question {i} " * 5), PARAMS)
    with pytest.raises(EngineOverloaded) as err:
        engine.add_request("too-many", user("one more"), PARAMS)
    assert err.value.retry_after_s >= 1
    outputs: dict = {}
    drain(engine, outputs)
    assert sorted(outputs) == [f"q{i}" for i in range(6)]  # nothing admitted was dropped
    # Saturation: lowest level and still over pressure → refuse quickly.
    engine.visual_budget.level = engine.visual_budget.lowest
    engine.visual_budget._above_since = time.monotonic() - 10
    engine.visual_budget._changed_at = time.monotonic() - 10
    with pytest.raises(EngineOverloaded):
        engine.add_request("shed", user("hello"), PARAMS)
    engine.close()


def test_one_client_with_huge_images_does_not_starve_another(tiny_ckpt):
    def steps_until_first_token(fair: bool) -> int:
        engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), max_num_batched_tokens=64))
        big = [make_image(1024, 768, s) for s in range(4)]
        for i, img in enumerate(big):
            engine.add_request(f"hog{i}", user(image_part(img), "describe"), PARAMS, client_key="hog")
        # The hog's images are encoded and its first prefill is under way.
        images = [im for st in engine.requests.values() for s in st.seqs for im in s.images]
        while not engine.scheduler.running or any(im.embedding is None for im in images):
            engine.step()
            engine.vision.request([im for im in images if im.embedding is None])
            engine.vision.wait(0.05)
        engine.add_request("small", user("hi"), PARAMS, client_key="polite" if fair else "hog")
        for step in range(1, 10_000):
            for out in engine.step():
                if out.request_id == "small" and out.token_ids:
                    engine.close()
                    return step
        raise AssertionError("never served")

    # ~4000 tokens of image prefill ahead of it: FIFO makes the small request wait for all of them.
    fair, unfair = steps_until_first_token(True), steps_until_first_token(False)
    assert fair <= 2 and unfair > 20, (fair, unfair)
