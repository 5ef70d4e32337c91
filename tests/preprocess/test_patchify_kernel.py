"""The compiled normalize_patchify (preprocess/csrc/patchify.c) against the numpy path, bit for bit.

The numpy path is itself checked against transformers' processors (test_preprocess_image.py), which
also run through the kernel wherever it builds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from preprocess import PreprocessConfig
from preprocess import image as image_mod
from preprocess.image import _normalize_patchify_numpy, normalize_patchify, resize
from tests.support import prerequisite

KERNEL = image_mod._patchify_kernel()
_kernel_built = prerequisite(
    None if KERNEL else "the patchify kernel did not build (no C compiler, or VLMSERVE_CPU_KERNELS=0)"
)

DEFAULT = PreprocessConfig()
ODD = PreprocessConfig(
    image_mean=(0.5, 0.25, 0.75),
    image_std=(0.3, 0.9, 0.07),
    rescale_factor=1 / 127.5,
)

CASES = [
    # (config, grid_h, grid_w): the default model (Qwen2-VL); one merge window; wide; tall; other
    # patch, merge and temporal sizes, odd and no merge; normalization constants of another model.
    (DEFAULT, 2, 2),
    (DEFAULT, 60, 82),
    (DEFAULT, 2, 40),
    (DEFAULT, 36, 4),
    (dataclasses.replace(DEFAULT, patch_size=16, merge_size=1, temporal_patch_size=1), 5, 7),
    (dataclasses.replace(DEFAULT, patch_size=7, merge_size=3, temporal_patch_size=3), 9, 6),
    (dataclasses.replace(DEFAULT, patch_size=1, merge_size=1, temporal_patch_size=4), 3, 5),
    (dataclasses.replace(ODD, patch_size=14, merge_size=2, temporal_patch_size=2), 10, 14),
]


def _pixels(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hwc = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    hwc[0, 0] = 0  # both ends of the table
    hwc[-1, -1] = 255
    return hwc


def _both(hwc: np.ndarray, config: PreprocessConfig) -> tuple[np.ndarray, np.ndarray]:
    rows = (hwc.shape[0] // config.patch_size) * (hwc.shape[1] // config.patch_size)
    ref = np.full((rows, config.patch_dim), np.nan, dtype=np.float32)
    got = np.full_like(ref, np.nan)
    _normalize_patchify_numpy(hwc, config, ref)
    normalize_patchify(hwc, config, got)
    return ref, got


@pytest.mark.parametrize("config,gh,gw", CASES)
def test_kernel_is_bit_identical(config, gh, gw):
    hwc = _pixels(gh * config.patch_size, gw * config.patch_size, seed=gh * 100 + gw)
    ref, got = _both(hwc, config)
    assert np.array_equal(got, ref)
    assert got.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()  # -0.0 vs 0.0 too


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_resize_outputs_are_used_in_place(backend):
    """Both resize backends' arrays (a torch channels-last view, PIL's read-only buffer) go in as they are."""
    config = dataclasses.replace(DEFAULT, resize_backend=backend)
    rgb = Image.fromarray(_pixels(301, 433, seed=7))
    hwc = resize(rgb, (12 * 28, 15 * 28), config)
    assert hwc.strides[1:] == (3, 1)
    ref, got = _both(hwc, config)
    assert np.array_equal(got, ref)


def test_strided_views():
    """Rows with padding go in as they are; other layouts (a planar image's view) are copied first."""
    padded = _pixels(56, 80, seed=3)[:, :56]
    planar = np.ascontiguousarray(_pixels(28, 56, seed=4).transpose(2, 0, 1)).transpose(1, 2, 0)
    for hwc in (padded, planar, padded[::-1]):
        ref, got = _both(hwc, DEFAULT)
        assert np.array_equal(got, ref)


def test_every_pixel_value():
    """All 256 values in every channel, once with the default constants and once with others."""
    hwc = np.zeros((28, 28 * 10, 3), dtype=np.uint8)
    hwc.reshape(-1, 3)[:256] = np.arange(256, dtype=np.uint8)[:, None]
    hwc.reshape(-1, 3)[256:512] = np.arange(255, -1, -1, dtype=np.uint8)[:, None]
    for config in (DEFAULT, ODD):
        ref, got = _both(hwc, config)
        assert np.array_equal(got, ref)


def test_bad_arguments_raise():
    hwc = _pixels(56, 56, seed=5)
    # zeros, not empty: out.astype(np.float64) below casts whatever the memory held (NaN bit patterns warn)
    out = np.zeros((16, DEFAULT.patch_dim), dtype=np.float32)
    with pytest.raises(ValueError, match="multiples of patch x merge"):  # 42 is no multiple of 28
        normalize_patchify(hwc[:42], DEFAULT, np.empty((12, DEFAULT.patch_dim), dtype=np.float32))
    with pytest.raises(ValueError, match="output"):
        normalize_patchify(hwc, DEFAULT, out[:15])
    with pytest.raises(ValueError, match="output"):
        normalize_patchify(hwc, DEFAULT, out.astype(np.float64))
    with pytest.raises(ValueError, match="output"):
        normalize_patchify(hwc, DEFAULT, np.empty((DEFAULT.patch_dim, 16), dtype=np.float32).T)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        normalize_patchify(hwc, DEFAULT, out)
    out = np.empty((16, DEFAULT.patch_dim), dtype=np.float32)
    for bad in (hwc.astype(np.float32), hwc[..., :2], hwc[..., 0]):
        with pytest.raises(ValueError, match="uint8"):
            normalize_patchify(bad, DEFAULT, out)


def test_kernel_refuses_bad_arguments():
    """Called directly: a nonzero code for each bad argument, and nothing written."""
    hwc = _pixels(56, 56, seed=6)
    out = np.zeros((16, 1176), dtype=np.float32)
    ms = np.ones(3, dtype=np.float32)

    def call(
        src=hwc.ctypes.data, h=56, w=56, stride=168, p=14, m=2, t=2, mean=ms.ctypes.data, dst=out.ctypes.data
    ):
        return KERNEL(src, h, w, stride, p, m, t, mean, ms.ctypes.data, dst)

    assert call() == 0
    out[:] = 0
    for kwargs in (
        {"src": None},
        {"mean": None},
        {"dst": None},
        {"h": 0},
        {"w": -28},
        {"p": 0},
        {"m": 0},
        {"t": 0},
        {"t": 65},
        {"h": 1 << 40},
        {"h": 42},
        {"w": 70},
        {"p": 5},
        {"stride": 167},
    ):
        assert call(**kwargs) < 0, kwargs
    assert not out.any()


def test_disabled_kernel_falls_back(monkeypatch, tmp_path):
    hwc = _pixels(56, 84, seed=8)
    ref = np.empty((24, DEFAULT.patch_dim), dtype=np.float32)
    normalize_patchify(hwc, DEFAULT, ref)
    monkeypatch.setenv("VLMSERVE_KERNEL_CACHE", str(tmp_path))
    try:
        monkeypatch.setenv("VLMSERVE_CPU_KERNELS", "0")
        image_mod._patchify_kernel.cache_clear()
        assert image_mod._patchify_kernel() is None
        got = np.empty_like(ref)
        normalize_patchify(hwc, DEFAULT, got)  # the numpy path
        assert np.array_equal(got, ref)
        # A failing compiler falls back the same way and leaves nothing behind.
        monkeypatch.delenv("VLMSERVE_CPU_KERNELS")
        monkeypatch.setenv("CC", "false")
        image_mod._patchify_kernel.cache_clear()
        assert image_mod._patchify_kernel() is None
        assert list(tmp_path.iterdir()) == []
        # A fresh build into an empty cache lands there, named after its source.
        monkeypatch.setenv("CC", "cc")
        image_mod._patchify_kernel.cache_clear()
        assert image_mod._patchify_kernel() is not None
        assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["patchify"]
    finally:
        image_mod._patchify_kernel.cache_clear()
