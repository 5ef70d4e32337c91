"""Greedy output with a video in the prompt equals transformers' generate() (float32, CPU), token for token, for
the three families: Qwen2-VL's temporal grid, Qwen2.5-VL's time-spaced M-RoPE (second_per_grid_ts), Qwen3-VL's
timestamp text between temporal patches. Clips of several lengths and rates, a frame count that is not a
multiple of the temporal patch (a frame list of 5), a video with an image, text after the video; through
chunked prefill (a 32-token budget cuts every video span) and again from the prefix cache."""

from __future__ import annotations

import pytest

from lm_engine import LLM, SamplingParams
from tests.support import HFOracle, image_part, make_clip, make_image, user

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ckpt(family, request):
    return request.getfixturevalue(
        {"qwen2_vl": "tiny_ckpt", "qwen2_5_vl": "tiny25_ckpt", "qwen3_vl": "qwen3_tiny_ckpt"}[family]
    )


@pytest.fixture(scope="module")
def oracle(family, ckpt, request) -> HFOracle:
    if family == "qwen3_vl":
        return HFOracle(ckpt)
    return request.getfixturevalue({"qwen2_vl": "hf_oracle", "qwen2_5_vl": "hf_oracle25"}[family])


def video(data, **extra) -> dict:
    return {"type": "video", "video": data, **extra}


def conversations() -> list[list[dict]]:
    short = make_clip(frames=9, width=64, height=48, fps=4, seed=0)
    frames = [make_image(56, 42, seed, "PNG") for seed in range(5)]
    return [
        user(video(short), "What happens?"),
        user(
            "See: ",
            video(make_clip(frames=20, width=90, height=50, fps=8, gop=6, seed=1), fps=3.0),
            " then say.",
        ),
        user(video(make_clip(frames=9, width=64, height=48, fps=4, seed=2)), "What happens?"),
        user(video(frames, fps=2.0), "Five frames."),
        user(image_part(make_image(56, 84, 3)), video(short), "Compare the two."),
    ]


def test_video_prompts_match_transformers(ckpt, oracle):
    convs = conversations()
    refs = [oracle.generate(c, MAX_NEW) for c in convs]
    assert refs[0] != refs[2], "two clips must lead to different answers for this test to bite"
    llm = LLM(
        str(ckpt), max_num_batched_tokens=32, block_size=16, num_kv_blocks=256, enable_prefix_caching=True
    )
    outs = llm.chat(convs, GREEDY)
    for i, (conv, out, ref) in enumerate(zip(convs, outs, refs)):
        assert out.prompt_token_ids == oracle.inputs(conv)["input_ids"][0].tolist(), f"prompt {i}"
        assert out.token_ids == ref, f"request {i}: engine {out.token_ids} != transformers {ref}"
    assert all(len(o.prompt_token_ids) > 32 for o in outs)  # every prompt took several prefill chunks
    again = llm.chat(convs, GREEDY)
    assert [o.token_ids for o in again] == refs
    assert sum(o.num_cached_tokens for o in again) > 0.5 * sum(len(o.prompt_token_ids) for o in again)
    llm.engine.check_integrity()
