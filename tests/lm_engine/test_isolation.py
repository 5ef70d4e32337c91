"""One request's failure inside a step stays its own: the others in the step go on with the tokens they would
have had without it (transformers' generate() is the oracle), and nothing it held stays behind. Only a fault
no single request explains fails the step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lm_engine.model_runner as model_runner
from lm_engine import EngineConfig, LLMEngine, SamplingParams
from tests.lm_engine.pacing import encoded_first
from tests.support import image_part, make_image, user

MAX_TOKENS = 6
GOOD = [
    user("Describe the weather in a short sentence."),
    user(image_part(make_image(56, 84, 3)), "What is in the picture?"),
    user("Count from one to five:"),
]
HOSTILE = user("Say something.")


def make_engine(ckpt) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(ckpt), max_num_batched_tokens=512, num_kv_blocks=64))
    encoded_first(engine)
    return engine


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[dict], SamplingParams]]) -> dict:
    for rid, (conv, params) in requests.items():
        engine.add_request(rid, conv, params)
    finished = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_integrity()
        if not engine.has_unfinished():
            break
    bm = engine.block_manager
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    assert not engine.images.ready and not engine.images.failed
    assert engine.admission.queued_requests == 0
    return finished


def good_requests() -> dict:
    return {
        f"good{i}": (conv, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        for i, conv in enumerate(GOOD)
    }


def assert_good_unchanged(finished: dict, hf_oracle) -> None:
    for i, conv in enumerate(GOOD):
        out = finished[f"good{i}"]
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.token_ids == hf_oracle.generate(conv, MAX_TOKENS), f"good{i}"


def assert_failed_alone(out) -> None:
    assert out.finished and out.error is not None
    assert out.error.status == 500 and out.error.code == "engine_error"


def test_parameters_the_sampler_cannot_apply_fail_their_request_only(tiny_ckpt, hf_oracle):
    """A number too large for any tensor (what validation at the door refuses, slipped past it here) used to
    fail the whole step, and with it every request decoding beside it."""
    engine = make_engine(tiny_ckpt)
    hostile = SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS)
    hostile.top_p = 10**400
    finished = run_all(engine, {**good_requests(), "hostile": (HOSTILE, hostile)})
    assert_failed_alone(finished["hostile"])
    assert_good_unchanged(finished, hf_oracle)


def test_a_request_whose_logprobs_fail_loses_only_itself(tiny_ckpt, hf_oracle):
    engine = make_engine(tiny_ckpt)
    hostile = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    hostile.logprobs = 10**6  # more alternatives than the vocabulary has: topk raises
    good = good_requests()
    good["good0"][1].logprobs = 1  # a row beside it that asks for them too
    finished = run_all(engine, {**good, "hostile": (HOSTILE, hostile)})
    assert_failed_alone(finished["hostile"])
    assert_good_unchanged(finished, hf_oracle)
    assert len(finished["good0"].outputs[0].logprobs) == MAX_TOKENS


def test_a_forward_pass_failing_on_one_request_goes_on_for_the_others(tiny_ckpt, hf_oracle, monkeypatch):
    """A step whose inputs cannot be built for one sequence runs again chunk by chunk: the failing one ends
    with its own error, the rest keep their KV and tokens."""
    real = model_runner.build_step

    def build_step(sched, *args):
        if any(c.seq.request_id == "hostile" for c in sched.chunks):
            raise ValueError("this request's inputs are broken")
        return real(sched, *args)

    monkeypatch.setattr(model_runner, "build_step", build_step)
    engine = make_engine(tiny_ckpt)
    finished = run_all(
        engine, {**good_requests(), "hostile": (HOSTILE, SamplingParams(max_tokens=MAX_TOKENS))}
    )
    assert_failed_alone(finished["hostile"])
    assert_good_unchanged(finished, hf_oracle)


def test_a_malformed_embedding_fails_the_requests_holding_it(tiny_ckpt, hf_oracle):
    """An embedding of the wrong shape (a bad cache entry) is refused where it enters the engine, not found by
    the forward pass of every request batched with it."""
    engine = make_engine(tiny_ckpt)
    conv = user(image_part(make_image(84, 56, 9)), "What is in the picture?")
    bad_key = engine.process_chat(conv).images[0].key
    real_take = engine.vision.take_results

    def take_results():
        return [replace(r, embedding=r.embedding[:-1]) if r.key == bad_key else r for r in real_take()]

    engine.vision.take_results = take_results
    finished = run_all(engine, {**good_requests(), "hostile": (conv, SamplingParams(max_tokens=MAX_TOKENS))})
    err = finished["hostile"].error
    assert err is not None and err.status == 500 and "MalformedEmbedding" in err.message
    assert_good_unchanged(finished, hf_oracle)


@pytest.mark.parametrize("when", ["always", "batched"])
def test_a_fault_no_single_request_explains_fails_the_step(tiny_ckpt, monkeypatch, when):
    """Once three requests decode together, the engine breaks: "always", every chunk fails alone too;
    "batched", each runs fine alone. Neither is one request's fault, so the step fails."""
    real = model_runner.build_step
    broken = False

    def build_step(sched, *args):
        if broken and (when == "always" or len(sched.chunks) > 1):
            raise RuntimeError("the engine is broken")
        return real(sched, *args)

    monkeypatch.setattr(model_runner, "build_step", build_step)
    engine = make_engine(tiny_ckpt)
    for rid, (conv, params) in good_requests().items():
        params.max_tokens = 50
        engine.add_request(rid, conv, params)
    for _ in range(50):
        engine.step()
        if len(engine.scheduler.running) == 3 and all(s.num_output_tokens for s in engine.scheduler.running):
            break
    assert len(engine.scheduler.running) == 3
    broken = True
    with pytest.raises(RuntimeError, match="the engine is broken"):
        engine.step()


def test_out_of_memory_is_the_engines_fault(tiny_ckpt, monkeypatch):
    def build_step(sched, *args):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(model_runner, "build_step", build_step)
    engine = make_engine(tiny_ckpt)
    engine.add_request("one", GOOD[0], SamplingParams(max_tokens=2))
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(50):
            engine.step()


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 10**400),
        ("top_k", 2**63),
        ("max_tokens", 10**30),
        ("min_tokens", -1),
        ("n", True),
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("logit_bias", {i: 1.0 for i in range(301)}),
        ("logit_bias", {5: float("nan")}),
        ("stop", ["x" * 2000]),
        ("stop_token_ids", [2**64]),
        ("seed", 2**63),
    ],
)
def test_sampling_params_refuse_what_a_step_could_not_apply(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_top_k_past_the_vocabulary_means_all_of_it(tiny_ckpt):
    """As vLLM clamps it: a top_k larger than the vocabulary samples as top_k = the vocabulary does (same seed,
    same ids)."""
    engine = make_engine(tiny_ckpt)
    conv = GOOD[0]
    vocab = engine.model_config.vocab_size
    a = SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_TOKENS, top_k=2**40)
    b = SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_TOKENS, top_k=vocab)
    finished = run_all(engine, {"a": (conv, a), "b": (conv, b)})
    assert finished["a"].error is None
    assert finished["a"].token_ids == finished["b"].token_ids
