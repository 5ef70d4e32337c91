"""Qwen2-VL's dynamic-resolution rule: image size + pixel budget → patch grid."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from preprocess.errors import ASPECT_RATIO, ZERO_SIZE, PreprocessError

if TYPE_CHECKING:
    from preprocess.config import PreprocessConfig
    from preprocess.probe import ImageInfo

MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels] where the
    rule allows, aspect ratio kept as closely as the rounding lets.

    NOTE: the float expressions and Python's round-half-to-even are those of transformers'
    smart_resize on purpose; the grid must agree with the model's reference processor exactly.
    """
    if height <= 0 or width <= 0:
        raise PreprocessError(ZERO_SIZE, f"image has zero size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise PreprocessError(
            ASPECT_RATIO,
            f"image aspect ratio {ratio:.1f} ({width}x{height}) exceeds the limit of {MAX_ASPECT_RATIO}",
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        # Shrink to fit; floor so the area stays under the budget, one factor at least per side.
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def plan_grid(
    info: ImageInfo, config: PreprocessConfig, max_pixels: int | None = None
) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) in patches, from header dimensions alone (no decode).

    `max_pixels` is the per-request visual budget; None uses the config's.
    """
    budget = config.max_pixels if max_pixels is None else max_pixels
    if budget <= 0:
        raise ValueError(f"max_pixels must be positive, got {budget}")
    h, w = smart_resize(info.height, info.width, config.factor, config.min_pixels, budget)
    # NOTE: a still image is one temporal patch (its frame repeated temporal_patch_size times).
    return 1, h // config.patch_size, w // config.patch_size


def num_visual_tokens(grid_thw: tuple[int, int, int], merge_size: int = 2) -> int:
    """Placeholder tokens the image takes in the prompt, after the merger's merge_size² pooling."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)
