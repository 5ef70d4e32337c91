"""Fixtures for the preprocess tests: synthetic images in many encodings, and transformers'
Qwen2-VL image processors as the oracle."""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image, ImageOps

from preprocess import PreprocessConfig


def synth_rgb(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Gradients + blobs + mild noise: compresses like a photo, not like white noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 6, 2).tolist() + [rng.uniform(0, 6.28)]
        img[..., c] = 127 + 90 * np.sin(2 * np.pi * (fx * x / width + fy * y / height) + phase)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(kind: str, width: int, height: int, seed: int = 0, orientation: int | None = None) -> bytes:
    """Encode a synthetic (width x height) image; `orientation` adds an EXIF tag (JPEG only)."""
    rgb = synth_rgb(width, height, seed)
    im = Image.fromarray(rgb)
    buf = io.BytesIO()
    if kind == "jpeg":
        kwargs = {}
        if orientation is not None:
            exif = Image.Exif()
            exif[0x0112] = orientation
            kwargs["exif"] = exif
        im.save(buf, "JPEG", quality=90, **kwargs)
    elif kind == "png":
        im.save(buf, "PNG")
    elif kind in ("rgba_png", "la_png"):
        # Alpha from transparent to opaque across the image, with a fully transparent corner.
        alpha = np.tile(np.linspace(0, 255, width, dtype=np.float32), (height, 1))
        alpha[: height // 4, : width // 4] = 0
        rgba = np.dstack([rgb, alpha.astype(np.uint8)])
        out = Image.fromarray(rgba)  # mode inferred as RGBA from the 4-channel array
        (out if kind == "rgba_png" else out.convert("LA")).save(buf, "PNG")
    elif kind == "l_png":
        im.convert("L").save(buf, "PNG")
    elif kind == "l_jpeg":
        im.convert("L").save(buf, "JPEG", quality=90)
    elif kind == "p_png":
        im.quantize(64).save(buf, "PNG")
    elif kind == "p_png_trns":
        im.quantize(64).save(buf, "PNG", transparency=3)
    elif kind == "cmyk_jpeg":
        im.convert("CMYK").save(buf, "JPEG", quality=90)
    elif kind == "i16_png":
        wide = (rgb[..., 0].astype(np.uint16) * 2).astype(np.uint16)  # values up to 510: PIL clips at 255
        Image.fromarray(wide).save(buf, "PNG")
    elif kind == "webp":
        im.save(buf, "WEBP", quality=90)
    elif kind == "gif":
        im.save(buf, "GIF")
    elif kind == "bmp":
        im.save(buf, "BMP")
    else:
        raise ValueError(kind)
    return buf.getvalue()


@pytest.fixture(scope="session")
def make_image() -> Callable[..., bytes]:
    return encode


@pytest.fixture(scope="session")
def config() -> PreprocessConfig:
    return PreprocessConfig()


@pytest.fixture(scope="session")
def hf_reference() -> Callable[..., tuple[np.ndarray, tuple[int, int, int]]]:
    """transformers' own processor on the same bytes: (pixel_values, grid_thw).

    The image is opened with PIL and EXIF-transposed first (transformers leaves a PIL image's
    orientation alone; load_image() would transpose, but also drop alpha).
    """
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processors: dict[tuple, object] = {}

    def run(
        data: bytes, config: PreprocessConfig, max_pixels: int | None = None
    ) -> tuple[np.ndarray, tuple[int, int, int]]:
        key = (config.resize_backend, config.image_mean, config.image_std, config.resample)
        if key not in processors:
            cls = (
                Qwen2VLImageProcessor if config.resize_backend == "torchvision" else Qwen2VLImageProcessorPil
            )
            resample = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3}[config.resample]
            processors[key] = cls(
                image_mean=list(config.image_mean),
                image_std=list(config.image_std),
                resample=resample,
                patch_size=config.patch_size,
                merge_size=config.merge_size,
                temporal_patch_size=config.temporal_patch_size,
            )
        size = {
            "shortest_edge": config.min_pixels,
            "longest_edge": config.max_pixels if max_pixels is None else max_pixels,
        }
        im = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        out = processors[key](images=im, size=size, return_tensors="np")
        return np.asarray(out["pixel_values"]), tuple(int(v) for v in out["image_grid_thw"][0])

    return run
