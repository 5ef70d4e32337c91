"""A choice ends at EOS where transformers' generate() ends it; with ``ignore_eos`` it runs on to max_tokens.

The tiny model never emits its own EOS greedily, so these tests run on ``eos_ckpt``: the same weights with
the EOS moved to a token that greedy answers produce early (tests/conftest.py).
"""

from __future__ import annotations

import json

import pytest

from lm_engine import LLM, SamplingParams
from tests.support import EOS_PROBE, image_part, make_image, user

MAX_NEW = 20
CONVS = [
    EOS_PROBE,
    user("Hi"),
    user(image_part(make_image(224, 224, 2)), "Describe the picture."),
    user("Look at this: ", image_part(make_image(300, 200, 3)), " and say what you see."),
]


@pytest.fixture(scope="module")
def eos_id(eos_ckpt) -> int:
    (eos,) = json.loads((eos_ckpt / "generation_config.json").read_text())["eos_token_id"]
    return eos


@pytest.fixture(scope="module")
def llm(eos_ckpt):
    with LLM(str(eos_ckpt), max_num_batched_tokens=128, num_kv_blocks=128) as engine:
        yield engine


def test_greedy_stops_at_eos_where_transformers_does(llm, eos_oracle, eos_id):
    refs = [eos_oracle.generate(c, MAX_NEW) for c in CONVS]
    assert len(refs[0]) < MAX_NEW and refs[0][-1] == eos_id, "the probe must end by EOS for this test to bite"
    outs = llm.chat(CONVS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"request {i}"
        ended_by_eos = ref[-1] == eos_id and eos_id not in ref[:-1]
        assert out.finish_reason == ("stop" if ended_by_eos else "length"), f"request {i}"
        assert out.outputs[0].stop_reason is None  # EOS, not a stop string or a stop token id


def test_ignore_eos_runs_to_max_tokens(llm, eos_oracle, eos_id):
    """transformers with no EOS at all is the reference: the choice goes on past the EOS it emits."""
    refs = [eos_oracle.generate(c, MAX_NEW, eos_token_id=None) for c in CONVS]
    assert eos_id in refs[0][:-1], "the probe must emit EOS before its end for this test to bite"
    outs = llm.chat(CONVS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert len(ref) == MAX_NEW
        assert out.token_ids == ref, f"request {i}"
        assert out.finish_reason == "length"
