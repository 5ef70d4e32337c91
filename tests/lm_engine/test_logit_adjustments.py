"""Logit adjustments (repetition, frequency and presence penalties, logit_bias, min_tokens, min_p): the engine's
greedy tokens equal transformers' generate() with its own processors for the same option, or with OpenAI's
documented penalty formula as a processor inside generate(); min_p's support equals transformers' warper's."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, MinPLogitsWarper

from lm_engine import LLM, SamplingParams
from lm_engine.sampler import sample
from lm_engine.sequence import Sequence
from tests.support import EOS_PROBE, image_part, make_image, user

MAX_NEW = 16
CONVS = [
    user("Tell me about the old lighthouse by the sea, and the keeper who lived there."),
    user(image_part(make_image(224, 168, 41)), "Describe the picture in detail."),
]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), max_num_batched_tokens=512, num_kv_blocks=256) as engine:
        yield engine


def greedy(**options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **options)


def engine_ids(llm, params: SamplingParams) -> list[list[int]]:
    return [out.token_ids for out in llm.chat(CONVS, params)]


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula: logit[j] -= c[j] · frequency_penalty + (c[j] > 0) · presence_penalty, c[j] the times
    token j was generated so far (prompt tokens do not count)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __repr__(self) -> str:  # HFOracle memoises by the repr of generate()'s arguments
        return f"OpenAIPenalties({self.prompt_len}, {self.frequency}, {self.presence})"

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len :], minlength=scores.shape[1]).to(
                scores.dtype
            )
            scores[row] -= counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence
        return scores


@pytest.mark.parametrize("penalty", [0.8, 0.5])
def test_repetition_penalty_equals_transformers(llm, hf_oracle, penalty):
    """The tiny model never picks a prompt token greedily, so a penalty above 1 changes nothing here; below 1
    (prompt and generated tokens favoured) the same processor changes every answer."""
    plain = [hf_oracle.generate(c, MAX_NEW) for c in CONVS]
    refs = [hf_oracle.generate(c, MAX_NEW, repetition_penalty=penalty) for c in CONVS]
    assert all(r != p for r, p in zip(refs, plain)), (
        "the penalty must change the answers for this test to bite"
    )
    assert engine_ids(llm, greedy(repetition_penalty=penalty)) == refs


@pytest.mark.parametrize("frequency, presence", [(2.0, 0.0), (1.0, 1.5), (-1.0, -1.0)])
def test_frequency_and_presence_penalties_equal_openais_formula(llm, hf_oracle, frequency, presence):
    """The tiny model repeats no token in 16, so each answer's first token gets +30 (logit_bias, transformers'
    sequence_bias) to make it repeat; the penalties then decide how often."""
    plain = [hf_oracle.generate(c, MAX_NEW) for c in CONVS]
    biased, refs = [], []
    for conv, answer in zip(CONVS, plain):
        bias = {(answer[0],): 30.0}
        prompt_len = hf_oracle.inputs(conv)["input_ids"].shape[1]
        processor = LogitsProcessorList([OpenAIPenalties(prompt_len, frequency, presence)])
        biased.append(hf_oracle.generate(conv, MAX_NEW, sequence_bias=bias))
        refs.append(hf_oracle.generate(conv, MAX_NEW, sequence_bias=bias, logits_processor=processor))
    assert refs != biased, "the penalties must change the answers for this test to bite"
    for conv, answer, ref in zip(CONVS, plain, refs):
        params = greedy(logit_bias={answer[0]: 30.0}, frequency_penalty=frequency, presence_penalty=presence)
        assert llm.chat([conv], params)[0].token_ids == ref


def test_penalties_count_generated_tokens_only():
    """OpenAI's formula on one row: token 0 generated twice, token 1 once, token 2 only in the prompt."""
    logits = torch.tensor([[10.0, 9.5, 8.0, 7.9]])
    seq = Sequence("x", [2, 2, 2, 0, 0, 1], 3, greedy(frequency_penalty=1.0, presence_penalty=0.6))
    # 10 - 2 - 0.6 = 7.4, 9.5 - 1 - 0.6 = 7.9, 8.0 (prompt only: untouched), 7.9
    assert sample(logits, [seq]) == [2]
    seq.params = greedy(frequency_penalty=1.0)  # 8.0, 8.5, 8.0, 7.9
    assert sample(logits, [seq]) == [1]


def test_logit_bias_equals_transformers_sequence_bias(llm, hf_oracle):
    plain = [hf_oracle.generate(c, MAX_NEW) for c in CONVS]
    banned, favoured = plain[0][0], plain[1][3]
    bias = {banned: -100.0, favoured: 6.0}
    refs = [
        hf_oracle.generate(c, MAX_NEW, sequence_bias={(tok,): b for tok, b in bias.items()}) for c in CONVS
    ]
    assert refs != plain and banned not in refs[0]
    assert engine_ids(llm, greedy(logit_bias=bias)) == refs


def test_adjustments_stay_on_their_own_row(llm, hf_oracle):
    """One request with a penalty beside one without, in one batch: the plain one is untouched."""
    plain = hf_oracle.generate(CONVS[1], MAX_NEW)
    penalised = hf_oracle.generate(CONVS[0], MAX_NEW, repetition_penalty=0.5)
    assert penalised != hf_oracle.generate(CONVS[0], MAX_NEW)
    outs = llm.chat(CONVS, [greedy(repetition_penalty=0.5), greedy()])
    assert [o.token_ids for o in outs] == [penalised, plain]


def test_min_tokens_equals_transformers_min_new_tokens(eos_ckpt, eos_oracle):
    stopped = eos_oracle.generate(EOS_PROBE, 24)
    assert len(stopped) < 10, "the EOS checkpoint must stop early for this test to bite"
    want = len(stopped) + 6
    ref = eos_oracle.generate(EOS_PROBE, 24, min_new_tokens=want)
    assert len(ref) > len(stopped)
    with LLM(str(eos_ckpt), max_num_batched_tokens=256, num_kv_blocks=128) as llm:
        (early,) = llm.chat([EOS_PROBE], SamplingParams(temperature=0.0, max_tokens=24))
        (out,) = llm.chat([EOS_PROBE], SamplingParams(temperature=0.0, max_tokens=24, min_tokens=want))
        # A stop string found in the first tokens does not end the answer before min_tokens either.
        stop = early.text[:2]
        (cut,) = llm.chat([EOS_PROBE], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))
        params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=want, stop=[stop])
        (held,) = llm.chat([EOS_PROBE], params)
    assert early.token_ids == stopped
    assert out.token_ids == ref and len(out.token_ids) >= want
    assert len(cut.token_ids) < want <= len(held.token_ids) and held.token_ids[:want] == ref[:want]


def test_min_p_keeps_what_transformers_warper_keeps():
    """The sampled support under temperature + min_p is the set transformers' MinPLogitsWarper leaves finite."""
    logits = torch.tensor([[3.0, 2.6, 2.0, 1.0, 0.2, -1.0, -3.0]])
    params = SamplingParams(temperature=0.9, min_p=0.2, max_tokens=1)
    kept = MinPLogitsWarper(min_p=0.2)(torch.zeros(1, 1, dtype=torch.long), logits / 0.9)
    allowed = set(torch.isfinite(kept[0]).nonzero().flatten().tolist())
    assert 1 < len(allowed) < logits.shape[1]
    seq = Sequence("x", [0], 1, params)
    seq.generator = torch.Generator().manual_seed(0)
    drawn = {sample(logits, [seq])[0] for _ in range(2000)}
    assert drawn == allowed


@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 3.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3.0},
        {"min_p": 1.5},
        {"min_tokens": 40},  # more than max_tokens
        {"logit_bias": {5: 101.0}},
        {"logit_bias": {-1: 1.0}},
    ],
)
def test_out_of_range_options_are_refused(options):
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=16, **options)
