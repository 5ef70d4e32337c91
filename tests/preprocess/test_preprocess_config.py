"""PreprocessConfig.from_checkpoint against transformers' reading of the same file; fingerprint."""

from __future__ import annotations

import json
import pickle

import pytest

from preprocess import PreprocessConfig

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _write(tmp_path, body: dict):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(body))
    return tmp_path


V4 = {  # the file Qwen2-VL-*-Instruct checkpoints ship
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
}
V5 = {  # what transformers 5 saves
    "image_processor_type": "Qwen2VLImageProcessor",
    "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 256 * 28 * 28},
    "resample": 3,
    "rescale_factor": 1 / 255,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@pytest.mark.parametrize("body", [V4, V5, {**V5, "min_pixels": 56 * 56, "max_pixels": 1000 * 28 * 28}])
def test_reads_what_transformers_reads(tmp_path, body):
    from transformers import AutoImageProcessor

    ckpt = _write(tmp_path, body)
    ours = PreprocessConfig.from_checkpoint(ckpt)
    ref = AutoImageProcessor.from_pretrained(ckpt)
    assert ref.backend == ours.resize_backend == "torchvision"
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    assert ours.image_mean == pytest.approx(tuple(ref.image_mean))
    assert ours.image_std == pytest.approx(tuple(ref.image_std))
    assert ours.rescale_factor == ref.rescale_factor
    assert ours.resample == "bicubic" and int(ref.resample) == 3
    assert (ours.patch_size, ours.merge_size, ours.temporal_patch_size) == (
        ref.patch_size,
        ref.merge_size,
        ref.temporal_patch_size,
    )


def test_reads_transformers5_unified_processor_config(tmp_path):
    from transformers import AutoImageProcessor

    (tmp_path / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor", "image_processor": V5})
    )
    ours = PreprocessConfig.from_checkpoint(tmp_path)
    ref = AutoImageProcessor.from_pretrained(tmp_path)
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    assert ours.image_mean == pytest.approx(tuple(ref.image_mean))


def test_overrides_and_errors(tmp_path):
    ckpt = _write(tmp_path, V4)
    assert PreprocessConfig.from_checkpoint(ckpt, draft=True).draft
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        PreprocessConfig.from_checkpoint(tmp_path / "missing")
    _write(tmp_path, {**V4, "do_normalize": False})
    with pytest.raises(ValueError, match="do_normalize"):
        PreprocessConfig.from_checkpoint(ckpt)
    _write(tmp_path, {**V4, "resample": 4})
    with pytest.raises(ValueError, match="resample"):
        PreprocessConfig.from_checkpoint(ckpt)


def test_fingerprint_is_stable_and_covers_pixel_affecting_fields():
    base = PreprocessConfig()
    fp = base.fingerprint()
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert PreprocessConfig().fingerprint() == fp
    assert pickle.loads(pickle.dumps(base)) == base
    assert pickle.loads(pickle.dumps(base)).fingerprint() == fp
    for change in (
        {"image_mean": (0.5, 0.5, 0.5)},
        {"image_std": (0.5, 0.5, 0.5)},
        {"patch_size": 16},
        {"merge_size": 1},
        {"temporal_patch_size": 1},
        {"resample": "bilinear"},
        {"resize_backend": "pil"},
        {"draft": True},
        {"rescale_factor": 1 / 256},
    ):
        assert base.replace(**change).fingerprint() != fp, change
    # Grid choice and acceptance limits are not pixel values: the grid is keyed separately.
    for same in (
        {"max_pixels": 28 * 28 * 64},
        {"min_pixels": 28 * 28},
        {"max_bytes": 10},
        {"max_image_pixels": 1},
    ):
        assert base.replace(**same).fingerprint() == fp, same


def test_rejects_invalid_values():
    with pytest.raises(ValueError, match="resample"):
        PreprocessConfig(resample="box")
    with pytest.raises(ValueError, match="image_std"):
        PreprocessConfig(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="resize_backend"):
        PreprocessConfig(resize_backend="opencv")
