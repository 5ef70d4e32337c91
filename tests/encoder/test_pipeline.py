"""The batched vision pipeline: batching is exact, duplicates are encoded once, bad images fail alone."""

from __future__ import annotations

import threading

import torch

from encoder import EncodeJob
from lm_engine import LLM, SamplingParams
from preprocess import preprocess
from tests.support import image_part, make_image, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def jobs_for(llm: LLM, images: list[bytes]) -> list[EncodeJob]:
    prompt = llm.engine.process_chat(user(*[image_part(d) for d in images], "?"))
    return [EncodeJob(im.key, prompt.image_data[im.key], im.max_pixels) for im in prompt.images]


def results_of(llm: LLM, jobs: list[EncodeJob], timeout: float = 30.0) -> dict:
    """Submit the jobs and collect every key's result (the engine's side of the hand-off)."""
    pipe = llm.engine.vision
    pipe.submit(jobs)
    results: dict = {}
    for _ in range(int(timeout / 0.05)):
        for r in pipe.take_results():
            results.setdefault(r.key, []).append(r)
        if {j.key for j in jobs} <= set(results):
            return results
        pipe.wait(0.05)
    raise AssertionError("vision pipeline did not finish")


def test_batched_encoding_equals_one_at_a_time(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), embedding_cache_bytes=0)
    images = [make_image(w, h, s) for s, (w, h) in enumerate([(56, 56), (224, 168), (333, 517), (640, 480)])]
    jobs = jobs_for(llm, images)
    # NOTE: the encoder is held until every image is preprocessed and queued, so what it packs does not
    # depend on how fast preprocessing is (alone, the first batch may hold one image; the rest go together).
    pipe, queued, all_queued = llm.engine.vision, [], threading.Event()
    enqueue, encode = pipe._enqueue, pipe.encode

    def counted(job, px, *rest):
        enqueue(job, px, *rest)
        queued.append(job.key)
        if len(queued) == len(jobs):
            all_queued.set()

    pipe._enqueue = counted
    pipe.encode = lambda pixels, grid: (all_queued.wait(60), encode(pixels, grid))[1]
    results = results_of(llm, jobs)
    assert llm.engine.vision.stats.batches < len(images)  # really packed together
    runner = llm.engine.runner
    for job in jobs:
        px = preprocess(job.data, llm.engine.preprocess_config)
        alone = runner.encode_images(torch.from_numpy(px.patches), torch.tensor([px.grid_thw]))
        torch.testing.assert_close(results[job.key][0].embedding, alone, rtol=1e-5, atol=1e-5)


def test_identical_images_in_flight_are_encoded_once(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), embedding_cache_bytes=0)
    img = make_image(224, 224, 42)
    jobs = [j for _ in range(4) for j in jobs_for(llm, [img, img])]
    assert len(jobs) == 8 and len({j.key for j in jobs}) == 1  # eight copies of one image: one key
    # NOTE: the encoder waits until every job has been submitted; otherwise a fast machine (or a slow
    # submitting loop) could finish the first encode before the last copy arrives.
    pipe, submitted = llm.engine.vision, threading.Event()
    encode = pipe.encode
    pipe.encode = lambda pixels, grid: (submitted.wait(30), encode(pixels, grid))[1]
    pipe.submit(jobs)
    submitted.set()
    results = results_of(llm, jobs)
    assert llm.engine.vision.stats.images == 1
    assert len(results[jobs[0].key]) == 1 and results[jobs[0].key][0].embedding is not None


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
    error = done["bad"].error
    assert error is not None and error.status == 400 and "image 0" in error.message
    assert done["good"].error is None and len(done["good"].token_ids) == 12
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert not eng.images.ready and not eng.images.failed  # nothing kept past its requests
    # The engine keeps serving.
    (again,) = llm.chat([user(image_part(good), "ok?")], GREEDY)
    assert again.token_ids == done["good"].token_ids


def test_cancelled_keys_never_reach_the_tower_and_may_be_asked_again(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), embedding_cache_bytes=0)
    pipe = llm.engine.vision
    running, dropped, again = jobs_for(
        llm, [make_image(224, 224, 51), make_image(160, 224, 52), make_image(224, 160, 53)]
    )
    # NOTE: the tower holds the first batch until the gate opens, so the other keys wait in the queue.
    entered, gate, encode = threading.Event(), threading.Event(), pipe.encode

    def gated(pixels, grid):
        entered.set()
        assert gate.wait(60)
        return encode(pixels, grid)

    pipe.encode = gated
    pipe.submit([running])
    assert entered.wait(60)
    pipe.submit([dropped, again])
    for _ in range(1200):  # a bound against hanging, not a pace
        if pipe.queued == 2:
            break
        pipe.wait(0.05)
    assert pipe.queued == 2
    assert not pipe.cancel(running.key)  # in the tower: its result comes as usual
    assert pipe.cancel(dropped.key) and pipe.cancel(again.key)
    assert not pipe.cancel(dropped.key) and pipe.pending == 1
    pipe.submit([again])  # asked again after its cancel: a fresh start; the stale copy stays dropped
    gate.set()
    results = []
    for _ in range(2400):  # a bound against hanging, not a pace
        results += pipe.take_results()
        if len(results) >= 2:
            break
        pipe.wait(0.05)
    assert sorted(r.key.image_hash for r in results) == sorted(j.key.image_hash for j in (running, again))
    assert all(r.error is None for r in results)
    assert pipe.stats.images == 2 and pipe.stats.cancelled == 2  # never the dropped key, again only once
    assert pipe.pending == 0 and pipe.queued == 0 and pipe.take_results() == []
    llm.close()
