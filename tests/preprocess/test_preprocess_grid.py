"""smart_resize / plan_grid against transformers' smart_resize, over random and extreme sizes."""

from __future__ import annotations

import random

import pytest
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize

from preprocess import PreprocessConfig, PreprocessError, num_visual_tokens, plan_grid, smart_resize
from preprocess.probe import ImageInfo


def _random_cases(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        h = int(10 ** rng.uniform(0, 4.3))  # 1 .. ~20000 px, log-uniform
        if rng.random() < 0.3:
            # Extreme aspect ratios, right up to the 200 limit.
            w = max(1, int(h * rng.choice([1 / 200, 1 / 199.5, 1 / 150, 150, 199.5, 200])))
        else:
            w = int(10 ** rng.uniform(0, 4.3))
        factor = rng.choice([28, 32, 56])
        min_pixels = rng.choice([56 * 56, 28 * 28 * 4, 256 * 28 * 28])
        max_pixels = rng.choice([28 * 28 * 16, 28 * 28 * 256, 28 * 28 * 1280, 12845056])
        yield h, w, factor, min_pixels, max_pixels


def test_matches_transformers_on_random_sizes():
    checked = errors = 0
    for h, w, factor, lo, hi in _random_cases(5000):
        try:
            expected = hf_smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
        except ValueError:
            with pytest.raises(PreprocessError):
                smart_resize(h, w, factor, lo, hi)
            errors += 1
            continue
        assert smart_resize(h, w, factor, lo, hi) == expected, (h, w, factor, lo, hi)
        checked += 1
    assert checked > 3500 and errors > 50


@pytest.mark.parametrize(
    ("h", "w"), [(1, 1), (1, 200), (200, 1), (28, 28), (14, 14), (42, 42), (70, 70), (3000, 15), (15, 3000)]
)
def test_matches_transformers_on_edge_sizes(h, w):
    for budget in (56 * 56, 28 * 28 * 1280):
        assert smart_resize(h, w, 28, 56 * 56, budget) == hf_smart_resize(h, w, 28, 56 * 56, budget)


@pytest.mark.parametrize(("h", "w"), [(1, 201), (1000, 4), (10, 2011)])
def test_aspect_ratio_over_200_is_a_clear_error(h, w):
    with pytest.raises(PreprocessError, match="aspect ratio") as info:
        smart_resize(h, w)
    assert info.value.code == "aspect_ratio"
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError):
        hf_smart_resize(h, w)


def test_zero_size_is_an_error():
    with pytest.raises(PreprocessError) as info:
        smart_resize(0, 10)
    assert info.value.code == "zero_size"


def test_plan_grid_and_token_count():
    config = PreprocessConfig()
    info = ImageInfo(width=1024, height=768, format="JPEG", orientation=1, mode="RGB")
    grid = plan_grid(info, config)
    h, w = hf_smart_resize(768, 1024, 28, config.min_pixels, config.max_pixels)
    assert grid == (1, h // 14, w // 14)
    assert num_visual_tokens(grid, 2) == h * w // (28 * 28)
    small = plan_grid(info, config, max_pixels=28 * 28 * 64)
    assert num_visual_tokens(small) <= 64
