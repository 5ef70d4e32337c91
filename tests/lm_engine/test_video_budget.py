"""A video's embedding-cache key and its visual budget: the key covers the bytes and every sampling choice that
changes the frames or the grid; the video ladder lowers frames first, then pixels, under load or detail="low",
and the level shows in the request's output; a repeated video is served from the embedding cache."""

from __future__ import annotations

import pytest

from lm_engine import LLM, SamplingParams
from lm_engine.visual_budget import DEFAULT_VIDEO_LADDER, VisualBudgetController, video_budget
from tests.support import make_clip, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
CLIP = make_clip(frames=24, width=112, height=84, fps=8, seed=5)


def video(data=CLIP, **extra) -> dict:
    return {"type": "video", "video": data, **extra}


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), num_kv_blocks=256, enable_prefix_caching=False) as llm:
        yield llm


def key_of(llm, part: dict, budget=None):
    chat = user(part, "Hi")
    prompt = llm.engine.processor.process_chat(chat, video_budget=(lambda d: budget) if budget else None)
    (item,) = {i.key: i for i in prompt.images}.values()
    return item


def test_key_covers_bytes_and_every_sampling_choice(llm):
    base = key_of(llm, video())
    assert key_of(llm, video()).key == base.key
    assert key_of(llm, video(fps=4.0)).key != base.key  # other frames
    assert key_of(llm, video(max_frames=4)).key != base.key
    smaller = key_of(llm, video(max_pixels=56 * 56))
    assert smaller.key != base.key and smaller.grid[1:] < base.grid[1:]
    other = key_of(llm, video(make_clip(frames=24, width=112, height=84, fps=8, seed=6)))
    assert other.key != base.key and other.grid == base.grid  # same shape, other bytes
    assert key_of(llm, video(), budget=None).key.cache_salt == ""


def test_video_ladder_lowers_frames_then_pixels(llm):
    controller = VisualBudgetController(ladder=[4, 3, 2, 1], ttft_slo_s=1.0)
    tokens = []
    for level in range(len(DEFAULT_VIDEO_LADDER)):
        controller.level = level
        budget = video_budget(controller, "auto")
        assert budget.level == level
        item = key_of(llm, video(), budget)
        assert item.video.level == level
        tokens.append((item.grid[0], item.grid[1] * item.grid[2], item.length))
    assert tokens[1][0] < tokens[0][0] and tokens[1][1] == tokens[0][1]  # fewer frames, same pixels
    assert tokens[2][1] < tokens[1][1]  # then fewer pixels
    assert [t[2] for t in tokens] == sorted((t[2] for t in tokens), reverse=True) and tokens[3][2] < tokens[
        0
    ][2]
    controller.level = 2
    assert video_budget(controller, "high").level == 0
    assert video_budget(controller, "low").level == len(DEFAULT_VIDEO_LADDER) - 1


def test_level_and_tokens_reported_and_repeat_hits_the_embedding_cache(llm, tiny_ckpt):
    full = llm.chat([user(video(), "Hi")], GREEDY)[0]
    assert full.visual_levels == [0] and full.video_tokens == sum(full.visual_tokens) > 0
    stats = llm.engine.vision.stats
    encoded, hits = stats.images, stats.cache_hits
    again = llm.chat([user(video(), "Hi")], GREEDY)[0]
    assert again.outputs[0].token_ids == full.outputs[0].token_ids
    assert stats.images == encoded and stats.cache_hits == hits + 1  # no second encode
    low = llm.chat([user(video(detail="low"), "Hi")], GREEDY)[0]
    assert low.visual_levels == [len(DEFAULT_VIDEO_LADDER) - 1]
    assert sum(low.visual_tokens) < sum(full.visual_tokens)
    with LLM(str(tiny_ckpt), num_kv_blocks=256, visual_level=1) as pinned:
        out = pinned.chat([user(video(), "Hi")], GREEDY)[0]
    assert out.visual_levels == [1] and sum(out.visual_tokens) < sum(full.visual_tokens)
