"""benchmarks/demo_eval.py's diagnostic of written numbers: the glyph height it reports is the height of the ink
in the pixels the tower sees, measured here on the picture itself (decoded and resized with Pillow)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from benchmarks.demo_eval import seen_glyph_height
from preprocess.grid import smart_resize
from tools import demo_tasks

MIN_PIXELS, FULL = 12_544, 100_352


def ink_rows(example: demo_tasks.Example, size: tuple[int, int]) -> int:
    """Rows (of the picture resized to ``size`` = (h, w)) holding ink: dark on light, so well under the
    background's brightness."""
    grey = np.asarray(Image.open(io.BytesIO(example.data)).convert("L").resize(size[::-1], Image.BICUBIC))
    dark = (grey < grey.max() - 80).any(axis=1)
    rows = np.flatnonzero(dark)
    return int(rows[-1] - rows[0] + 1)


def test_seen_glyph_height_is_the_inks_height_after_the_resize():
    examples = [demo_tasks.sample(4242, i, kind="number", fmt="PNG") for i in range(12)]
    checked = 0
    for ex in examples:
        for budget in (FULL, FULL // 4):
            width, height = ex.size
            size = smart_resize(height, width, min_pixels=MIN_PIXELS, max_pixels=budget)
            want = ink_rows(ex, size)
            if want < 10:  # a few pixels of resampled ink: too blurred to measure to a pixel
                continue
            got = seen_glyph_height(ex, MIN_PIXELS, budget)
            assert abs(got - want) <= max(2.0, 0.08 * want), (ex.size, budget, got, want)
            checked += 1
    assert checked >= 12
