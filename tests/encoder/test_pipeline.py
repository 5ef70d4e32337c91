"""The batched vision pipeline: batching is exact, duplicates are encoded once, bad images fail alone."""

from __future__ import annotations

import threading

import torch

from lm_engine import LLM, SamplingParams
from preprocess import preprocess
from tests.support import image_part, make_image, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def items_for(llm: LLM, images: list[bytes]):
    prompt = llm.engine.process_chat(user(*[image_part(d) for d in images], "?"))
    return prompt.images


def wait_all(llm: LLM, items, timeout: float = 30.0) -> None:
    pipe = llm.engine.vision
    pipe.request(items)
    for _ in range(int(timeout / 0.05)):
        if all(i.embedding is not None or i.error is not None for i in items):
            return
        pipe.wait(0.05)
    raise AssertionError("vision pipeline did not finish")


def test_batched_encoding_equals_one_at_a_time(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), embedding_cache_bytes=0, encoder_max_wait_ms=200)
    images = [make_image(w, h, s) for s, (w, h) in enumerate([(56, 56), (224, 168), (333, 517), (640, 480)])]
    batched = items_for(llm, images)
    wait_all(llm, batched)
    assert llm.engine.vision.stats.batches < len(images)  # really packed together
    runner = llm.engine.runner
    for item in batched:
        px = preprocess(item.data, llm.engine.preprocess_config)
        alone = runner.encode_images(torch.from_numpy(px.patches), torch.tensor([px.grid_thw]))
        torch.testing.assert_close(item.embedding, alone, rtol=1e-5, atol=1e-5)


def test_identical_images_in_flight_are_encoded_once(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), embedding_cache_bytes=0)
    img = make_image(224, 224, 42)
    items = [it for _ in range(4) for it in items_for(llm, [img, img])]
    # NOTE: the encoder waits until every item has been requested; otherwise a fast machine (or a slow
    # request loop) could finish the first encode before the last copy is requested.
    pipe, requested = llm.engine.vision, threading.Event()
    encode = pipe.encode
    pipe.encode = lambda pixels, grid: (requested.wait(30), encode(pixels, grid))[1]
    pipe.request(items)
    requested.set()
    wait_all(llm, items)
    assert llm.engine.vision.stats.images == 1
    assert all(it.embedding is items[0].embedding for it in items)


def test_bad_image_fails_only_its_request(tiny_ckpt):
    llm = LLM(str(tiny_ckpt))
    good = make_image(224, 224, 1, "JPEG")
    truncated = good[: len(good) // 2]  # the header probes fine; decoding fails
    eng = llm.engine
    eng.add_request("good", user(image_part(good), "ok?"), GREEDY)
    eng.add_request("bad", user(image_part(truncated), "ok?"), GREEDY)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_integrity()
    assert done["bad"].error is not None and "image 0" in done["bad"].error["message"]
    assert done["good"].error is None and len(done["good"].token_ids) == 12
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    # The engine keeps serving.
    (again,) = llm.chat([user(image_part(good), "ok?")], GREEDY)
    assert again.token_ids == done["good"].token_ids
