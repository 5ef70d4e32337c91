"""Image bytes → Qwen2-VL pixel patches, numerically the same as transformers' Qwen2VLImageProcessor.

Steps: lazy open and limit checks (probe.py), plan the grid from the header, decode (optionally
in JPEG draft mode), EXIF-orient, convert to RGB, resize to the grid, rescale + normalize and
patchify straight into the output buffer (which the pool places in shared memory).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from preprocess.config import PreprocessConfig
from preprocess.errors import CORRUPT, DECOMPRESSION_BOMB, PreprocessError
from preprocess.grid import plan_grid
from preprocess.probe import ImageInfo, open_image

# EXIF orientation → the transpose that makes the image upright (as PIL.ImageOps.exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_PIL_FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_DRAFT_FORMATS = ("JPEG", "MPO")

Allocator = Callable[[tuple[int, int]], np.ndarray]


@dataclass(slots=True)
class PixelPatches:
    """Flattened patches in transformers' order, ready for the vision tower.

    patches: float32 [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]
    """

    patches: np.ndarray
    grid_thw: tuple[int, int, int]


def preprocess(data: bytes, config: PreprocessConfig, max_pixels: int | None = None) -> PixelPatches:
    """Encoded image → pixel patches. `max_pixels` is the request's visual budget (None: config's)."""
    return preprocess_into(data, config, max_pixels, lambda shape: np.empty(shape, dtype=np.float32))


def preprocess_into(
    data: bytes, config: PreprocessConfig, max_pixels: int | None, alloc: Allocator
) -> PixelPatches:
    """preprocess(), writing the patches into `alloc(shape)` (float32, C-contiguous)."""
    im, info = open_image(data, config)
    grid = plan_grid(info, config, max_pixels)
    _, grid_h, grid_w = grid
    size = (grid_h * config.patch_size, grid_w * config.patch_size)
    rgb = decode_rgb(im, info, config, size)
    resized = resize(rgb, size, config)
    out = alloc((grid_h * grid_w, config.patch_dim))
    normalize_patchify(resized, config, out)
    return PixelPatches(patches=out, grid_thw=grid)


def decode_rgb(
    im: Image.Image, info: ImageInfo, config: PreprocessConfig, size: tuple[int, int]
) -> Image.Image:
    """Decode the lazily opened image, upright and in RGB. `size` (h, w) is the resize target."""
    try:
        if config.draft and info.format in _DRAFT_FORMATS:
            h, w = size
            raw_target = (h, w) if info.orientation >= 5 else (w, h)
            # PIL picks the largest DCT scale 1/2, 1/4 or 1/8 that keeps both sides >= the target,
            # so draft never upsamples and does nothing below 2x.
            im.draft("RGB", raw_target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im.load()
        if (method := _UPRIGHT.get(info.orientation)) is not None:
            im = im.transpose(method)
        return to_rgb(im)
    except Image.DecompressionBombError as e:
        raise PreprocessError(DECOMPRESSION_BOMB, f"image rejected as a decompression bomb: {e}") from None
    except MemoryError:
        raise
    except Exception as e:  # PIL decoders raise many types on malformed input
        raise PreprocessError(CORRUPT, f"{info.format} image data is truncated or corrupt: {e}") from None


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB, with any transparency composited over white.

    NOTE: the rule of transformers' convert_to_rgb for PIL inputs: alpha band or a `transparency`
    entry (palette/greyscale keyed transparency) means composite; everything else (L, P, CMYK,
    I;16, ...) goes through PIL's plain convert, which clips 16-bit values at 255.
    """
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def resize(rgb: Image.Image, size: tuple[int, int], config: PreprocessConfig) -> np.ndarray:
    """Resize to `size` (h, w); returns uint8 [3, h, w]."""
    if config.resize_backend == "pil":
        h, w = size
        if rgb.size != (w, h):
            rgb = rgb.resize((w, h), _PIL_FILTERS[config.resample])
        return np.asarray(rgb).transpose(2, 0, 1)
    return _resize_torchvision(rgb, size, config.resample)


def _resize_torchvision(rgb: Image.Image, size: tuple[int, int], resample: str) -> np.ndarray:
    # Imported here so header-only users (probe, plan_grid) never pay for torch.
    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    modes = {
        "nearest": InterpolationMode.NEAREST_EXACT,
        "bilinear": InterpolationMode.BILINEAR,
        "bicubic": InterpolationMode.BICUBIC,
        "lanczos": InterpolationMode.LANCZOS,
    }
    # NOTE: the same tensor layout and call as transformers' TorchvisionBackend: a contiguous
    # [1, C, H, W] uint8 batch. torch's uint8 kernels differ from PIL's by up to ~20 levels,
    # and may differ by memory format, so the layout is part of matching the reference.
    hwc = np.array(rgb)  # writable copy; torch.from_numpy rejects read-only views
    chw = torch.from_numpy(hwc).permute(2, 0, 1).contiguous().unsqueeze(0)
    out = tvF.resize(chw, list(size), interpolation=modes[resample], antialias=True)
    return out[0].numpy()


def normalize_patchify(chw: np.ndarray, config: PreprocessConfig, out: np.ndarray) -> None:
    """(x - mean/rescale) / (std/rescale) in float32, written in transformers' patch order.

    out: [grid_h * grid_w, 3 * T * p * p]; rows run over merge windows (row-major), then the
    m x m patches inside a window; each row is (channel, temporal copy, patch row, patch col).
    """
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    c, h, w = chw.shape
    gh, gw = h // p, w // p
    # NOTE: rescale folded into mean/std exactly as transformers' fused path (float32 mean * 255,
    # then subtract and divide), so the values match bit for bit rather than to ~1e-7.
    inv = np.float32(1.0 / config.rescale_factor)
    mean = (np.asarray(config.image_mean, dtype=np.float32) * inv).reshape(c, 1, 1)
    std = (np.asarray(config.image_std, dtype=np.float32) * inv).reshape(c, 1, 1)
    # Normalize contiguously first, then one strided copy; ~3x faster than normalizing in place
    # through the patch-ordered view.
    x = np.subtract(chw, mean, dtype=np.float32)
    np.divide(x, std, out=x)
    src = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    out.reshape(gh // m, gw // m, m, m, c, t, p, p)[...] = src[:, :, :, :, :, None]
