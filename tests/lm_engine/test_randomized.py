"""A randomized run: 200+ requests with random lengths, images, n, stops and aborts; invariants every step."""

from __future__ import annotations

import random

import pytest
import torch

from lm_engine import EngineConfig, LLMEngine, SamplingParams
from tests.lm_engine.pacing import encoded_first
from tests.support import image_part, make_image

WORDS = "the a page table shows seven blue cats under old bridges near one quiet river at dawn".split()
STOPS = ["e ", "at", "s", "\n", "qu", "oo"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_randomized_run_keeps_invariants_and_frees_everything(tiny_ckpt, prefix_caching):
    rng = random.Random(1234 + prefix_caching)
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_ckpt),
            max_num_batched_tokens=96,
            max_num_seqs=12,
            num_kv_blocks=40,
            enable_prefix_caching=prefix_caching,
        )
    )
    # NOTE: what each step runs must depend neither on the encoder threads' pace nor on the process's RNG
    # (unseeded requests sample from it), or neither would the random choices below that read the engine's
    # state (which request to abort), nor what the run exercised: the same run on any machine.
    encoded_first(engine)
    torch.manual_seed(4321 + prefix_caching)
    images = [make_image(rng.choice([28, 56, 84, 140]), rng.choice([28, 56, 112]), seed) for seed in range(6)]
    shared = "You read documents. " * 4

    def random_request() -> tuple[list[dict], SamplingParams]:
        parts = [
            {
                "type": "text",
                "text": (shared if rng.random() < 0.5 else "")
                + " ".join(rng.choices(WORDS, k=rng.randint(1, 40))),
            }
        ]
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            parts.insert(rng.randint(0, len(parts)), image_part(rng.choice(images)))
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]),
            temperature=rng.choice([0.0, 0.0, 0.7, 1.5]),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9, 0.5]),
            seed=rng.choice([None, rng.randint(0, 10**6)]),
            max_tokens=rng.randint(1, 24),
            stop=rng.sample(STOPS, k=rng.randint(0, 2)),
            stop_token_ids=rng.sample(range(100, 2000), k=rng.randint(0, 3)),
        )
        return [{"role": "user", "content": parts}], params

    total, added, aborted = 220, 0, set()
    params_of: dict[str, SamplingParams] = {}
    finished: dict[str, object] = {}
    steps = 0
    while added < total or engine.has_unfinished():
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if added < total:
                conv, params = random_request()
                rid = f"r{added}"
                engine.add_request(rid, conv, params)
                params_of[rid] = params
                added += 1
        if engine.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(engine.requests))
            assert engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_integrity()
        steps += 1
        assert steps < 20000, "the engine stopped making progress"

    assert set(finished) | aborted == set(params_of)
    bm = engine.block_manager
    # Every block is free; with prefix caching some keep their hash as evictable cache entries.
    assert bm.num_free_blocks == bm.num_blocks
    assert all(r == 0 for r in bm.allocator.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for rid, out in finished.items():
        p = params_of[rid]
        assert len(out.outputs) == p.n
        for choice in out.outputs:
            assert 1 <= len(choice.token_ids) <= p.max_tokens
            assert choice.finish_reason in ("stop", "length")
            if choice.finish_reason == "length":
                assert len(choice.token_ids) == p.max_tokens
            if isinstance(choice.stop_reason, str):
                assert choice.stop_reason in p.stop and not any(s in choice.text for s in p.stop)
    # The run really exercised what it claims to.
    reasons = [c.stop_reason for o in finished.values() for c in o.outputs]
    assert aborted and any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    assert any(len(o.outputs) > 1 for o in finished.values())
    assert any(o.visual_tokens for o in finished.values())
    assert engine.scheduler.num_preemptions > 0  # the small pool forces recompute preemption
    if prefix_caching:
        assert bm.prefix_hits > 0
    print(
        f"steps={steps} preemptions={engine.scheduler.num_preemptions} aborted={len(aborted)} "
        f"prefix hit tokens={bm.prefix_hits}/{bm.prefix_queries}"
    )
