"""Preprocessing settings, read from a checkpoint's preprocessor_config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# PIL's integer resample codes, as checkpoints store them.
_PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
RESAMPLE_MODES = ("nearest", "bilinear", "bicubic", "lanczos")
RESIZE_BACKENDS = ("torchvision", "pil")

# NOTE: bump when preprocess() changes its numbers for the same config, so cached embeddings
# made by the old code stop matching.
_FINGERPRINT_SCHEMA = "vlmserve.preprocess.v1"


@dataclass(frozen=True, slots=True)
class PreprocessConfig:
    """How image bytes become Qwen2-VL pixel patches.

    resize_backend "torchvision" reproduces transformers' default Qwen2VLImageProcessor (uint8
    tensor resize); "pil" reproduces Qwen2VLImageProcessorPil (PIL resize). `draft` lets large
    JPEGs decode at 1/2, 1/4 or 1/8 scale first: faster, but no longer bit-equal to transformers.
    max_image_pixels, max_bytes and formats only decide what is accepted.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: str = "bicubic"
    resize_backend: str = "torchvision"
    draft: bool = False
    max_image_pixels: int = 64_000_000
    max_bytes: int = 32 * 1024 * 1024
    # NOTE: a whitelist of PIL opener names, so untrusted bytes never reach PIL's rarer decoders
    # (EPS runs Ghostscript). MPO (multi-picture JPEG) opens through "JPEG".
    formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP")

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
        object.__setattr__(self, "formats", tuple(f.upper() for f in self.formats))
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if any(s == 0 for s in self.image_std):
            raise ValueError("image_std must not contain zeros")
        if self.resample not in RESAMPLE_MODES:
            raise ValueError(f"resample must be one of {RESAMPLE_MODES}, got {self.resample!r}")
        if self.resize_backend not in RESIZE_BACKENDS:
            raise ValueError(f"resize_backend must be one of {RESIZE_BACKENDS}, got {self.resize_backend!r}")
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def factor(self) -> int:
        """Side length, in pixels, of one merged visual token."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def fingerprint(self) -> str:
        """xxh3_128 hex of every field that changes pixel values for a given grid.

        min/max_pixels are left out on purpose: they only choose the grid, and the grid is
        already part of the embedding-cache key. Acceptance limits are left out too.

        NOTE: xxh3 whatever --hash-algorithm says: the operator writes this config, no client does, and the key
        that carries the fingerprint is hashed with the chosen algorithm.
        """
        canonical = {
            "schema": _FINGERPRINT_SCHEMA,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "resample": self.resample,
            "resize_backend": self.resize_backend,
            "draft": self.draft,
        }
        return xxhash.xxh3_128_hexdigest(json.dumps(canonical, sort_keys=True).encode())

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, **overrides: Any) -> PreprocessConfig:
        """Read a checkpoint's Qwen2VLImageProcessor settings.

        From `preprocessor_config.json`, or else the `image_processor` entry of the unified
        `processor_config.json` that transformers 5 saves. Accepts both the v4
        `min_pixels`/`max_pixels` keys and the v5 `size` dict; as in transformers, the explicit
        keys win. `overrides` set fields the file does not hold.
        """
        path, raw = _read_processor_config(Path(checkpoint_dir))
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(flag, True) is False:
                raise ValueError(f"{path}: {flag}=false is not supported")

        fields: dict[str, Any] = {}
        for name in ("patch_size", "merge_size", "temporal_patch_size", "rescale_factor"):
            if name in raw:
                fields[name] = raw[name]
        for name in ("image_mean", "image_std"):
            if name in raw:
                fields[name] = tuple(raw[name])
        size = raw.get("size") or {}
        min_pixels = raw.get("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
        max_pixels = raw.get("max_pixels", size.get("longest_edge", size.get("max_pixels")))
        if min_pixels is not None:
            fields["min_pixels"] = int(min_pixels)
        if max_pixels is not None:
            fields["max_pixels"] = int(max_pixels)
        if "resample" in raw:
            resample = raw["resample"]
            fields["resample"] = (
                _PIL_RESAMPLE.get(resample, resample) if isinstance(resample, int) else resample
            )
        fields.update(overrides)
        return cls(**fields)

    def replace(self, **changes: Any) -> PreprocessConfig:
        return dataclasses.replace(self, **changes)


def _read_processor_config(checkpoint_dir: Path) -> tuple[Path, dict[str, Any]]:
    path = checkpoint_dir / "preprocessor_config.json"
    if path.is_file():
        return path, json.loads(path.read_text())
    unified = checkpoint_dir / "processor_config.json"
    if unified.is_file() and isinstance(sub := json.loads(unified.read_text()).get("image_processor"), dict):
        return unified, sub
    raise FileNotFoundError(
        f"checkpoint has no image processor config: neither {path} nor an `image_processor` entry in "
        f"{unified} was found"
    )
