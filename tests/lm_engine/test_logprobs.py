"""Log-probabilities: each generated token's, and the top alternatives', equal the log-softmax of transformers'
logits at that step (its generate() for greedy answers, a forward pass over prompt + answer for sampled ones):
the model's distribution, before penalties and temperature, as vLLM reports it by default."""

from __future__ import annotations

import pytest
import torch

from lm_engine import LLM, SamplingParams
from tests.support import image_part, make_image, user

MAX_NEW = 8
CONVS = [
    user("Tell me about the old lighthouse by the sea."),
    user(image_part(make_image(224, 168, 41)), "Describe the picture in detail."),
]
TOL = 1e-4  # float32 on both sides; observed differences ~1e-5


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    # A 64-token budget cuts the image's prompt into chunks: the logits of its last chunk are the ones used.
    with LLM(str(tiny_ckpt), max_num_batched_tokens=64, num_kv_blocks=256) as engine:
        yield engine


@torch.no_grad()
def hf_steps(oracle, conv, answer: list[int]) -> torch.Tensor:
    """[len(answer), V] log-probabilities transformers' model gives each answer token's step (teacher forcing)."""
    inputs = oracle.inputs(conv)
    ids = torch.cat([inputs["input_ids"], torch.tensor([answer])], dim=1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in extra:  # per prompt token (0: text); the answer is text
        extra["mm_token_type_ids"] = torch.cat(
            [extra["mm_token_type_ids"], torch.zeros(1, len(answer), dtype=extra["mm_token_type_ids"].dtype)],
            1,
        )
    logits = oracle.model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
    start = inputs["input_ids"].shape[1] - 1
    return logits[start : start + len(answer)].float().log_softmax(dim=-1)


def check(out, ref: torch.Tensor, k: int) -> None:
    entries = out.logprobs
    assert entries is not None and [e.token_id for e in entries] == out.token_ids
    for step, e in enumerate(entries):
        assert abs(e.logprob - ref[step, e.token_id].item()) < TOL
        values, ids = ref[step].topk(k)
        assert [t for t, _, _ in e.top] == ids.tolist()
        assert max((abs(lp - v) for (_, _, lp), v in zip(e.top, values.tolist())), default=0.0) < TOL
        assert all(isinstance(text, str) for _, text, _ in e.top) and isinstance(e.token, str)


@pytest.mark.parametrize("k", [0, 5])
def test_greedy_logprobs_equal_transformers(llm, hf_oracle, k):
    outs = llm.chat(CONVS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=k))
    for conv, out in zip(CONVS, outs):
        choice = out.outputs[0]
        assert choice.token_ids == hf_oracle.generate(conv, MAX_NEW)
        check(choice, hf_steps(hf_oracle, conv, choice.token_ids), k)
        if k:  # greedy: the chosen token is the likeliest
            assert all(e.top[0][0] == e.token_id for e in choice.logprobs)


def test_sampled_choices_report_the_models_own_distribution(llm, hf_oracle):
    """n = 2 at temperature 1.7 with a repetition penalty: each choice's logprobs are the raw model's for its
    own tokens (not the tempered, penalised distribution it was drawn from)."""
    params = SamplingParams(
        n=2, temperature=1.7, seed=5, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=0.7, logprobs=3
    )
    (out,) = llm.chat([CONVS[1]], params)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for choice in out.outputs:
        check(choice, hf_steps(hf_oracle, CONVS[1], choice.token_ids), 3)


def test_no_logprobs_unless_asked(llm):
    (out,) = llm.chat([CONVS[0]], SamplingParams(temperature=0.0, max_tokens=4))
    assert out.outputs[0].logprobs is None


def test_out_of_range_logprobs_are_refused():
    for k in (-1, 21):
        with pytest.raises(ValueError):
            SamplingParams(logprobs=k)
