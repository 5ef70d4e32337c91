"""preprocess() against transformers' Qwen2-VL image processors on the same bytes.

Tolerance: max |ours - transformers| <= 1e-5 (normalized units) for both resize backends. With
the default torchvision backend the values are in fact bit-identical (same resize call, same
fused float32 normalize); the PIL backend differs by ~2e-7 from rescaling in float32 instead of
transformers' float64.
"""

from __future__ import annotations

import io

import numpy as np
import PIL
import pytest
from PIL import Image

from preprocess import PreprocessConfig, num_visual_tokens, plan_grid, preprocess, probe
from preprocess import image as image_mod
from tests.support import skip_or_fail

TOL = 1e-5
KINDS = (
    "jpeg",
    "png",
    "rgba_png",
    "la_png",
    "l_png",
    "l_jpeg",
    "p_png",
    "p_png_trns",
    "cmyk_jpeg",
    "i16_png",
    "webp",
    "gif",
    "bmp",
)


def assert_matches(ours, ref) -> None:
    pixel_values, grid = ref
    assert ours.grid_thw == grid
    assert ours.patches.dtype == np.float32 and ours.patches.flags.c_contiguous
    assert ours.patches.shape == pixel_values.shape
    assert np.abs(ours.patches - pixel_values).max() <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_every_mode_matches_transformers(kind, make_image, config, hf_reference):
    data = make_image(kind, 333, 517, seed=1)
    assert_matches(preprocess(data, config), hf_reference(data, config))


@pytest.mark.parametrize("size", [(56, 56), (224, 224), (333, 517), (1024, 768), (1000, 60), (37, 81)])
@pytest.mark.parametrize("kind", ["jpeg", "png"])
def test_resolutions_match_transformers(size, kind, make_image, config, hf_reference):
    data = make_image(kind, *size, seed=2)
    assert_matches(preprocess(data, config), hf_reference(data, config))


@pytest.mark.parametrize("max_pixels", [56 * 56, 28 * 28 * 16, 28 * 28 * 64, 28 * 28 * 256, 2048 * 2048])
def test_max_pixels_matches_transformers(max_pixels, make_image, config, hf_reference):
    data = make_image("jpeg", 1024, 768, seed=3)
    ours = preprocess(data, config, max_pixels=max_pixels)
    assert_matches(ours, hf_reference(data, config, max_pixels))
    assert ours.grid_thw == plan_grid(probe(data), config, max_pixels)


@pytest.mark.parametrize("size", [(37, 81), (333, 517), (1000, 60)])
@pytest.mark.parametrize("max_pixels", [None, 28 * 28 * 16])
def test_a_picture_in_memory_gives_its_pngs_patches(size, max_pixels, make_image, config, hf_reference):
    """preprocess_picture(picture) is preprocess() of the picture's PNG file, to the bit, and so transformers'."""
    data = make_image("png", *size, seed=5)
    picture = Image.open(io.BytesIO(data)).convert("RGB")
    ours = image_mod.preprocess_picture(picture, config, max_pixels)
    from_file = preprocess(data, config, max_pixels)
    assert ours.grid_thw == from_file.grid_thw
    assert np.array_equal(ours.patches, from_file.patches)
    assert_matches(ours, hf_reference(data, config, max_pixels))
    with pytest.raises(ValueError, match="RGB"):
        image_mod.preprocess_picture(picture.convert("L"), config)


@pytest.mark.parametrize("resample", ["bicubic", "bilinear", "nearest", "lanczos"])
def test_torchvision_backend_is_bit_identical(resample, hf_reference):
    """Not just within TOL: we hand torch a channels-last view where transformers passes a
    contiguous batch, and rely on torch's uint8 kernels computing the same integers either way.
    Noise-heavy pixels, odd sizes, down- and upscaling, so any rounding difference would show."""
    config = PreprocessConfig(resample=resample)
    rng = np.random.default_rng(11)
    for width, height, max_pixels in [(1283, 977, None), (517, 333, 28 * 28 * 64), (61, 97, None)]:
        noisy = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noisy).save(buf, "PNG")
        ours = preprocess(buf.getvalue(), config, max_pixels)
        pixel_values, grid = hf_reference(buf.getvalue(), config, max_pixels)
        assert ours.grid_thw == grid
        assert np.array_equal(ours.patches, pixel_values), (width, height, resample)


@pytest.mark.parametrize("capability", ["native", "DEFAULT"])
def test_torch_resize_is_torchvisions_call(capability, monkeypatch):
    """The resize we run without importing torchvision equals torchvision's own ``resize`` (the call
    transformers makes, on the contiguous [1, C, H, W] batch it passes) bit for bit, in every mode, down,
    up and unchanged. "DEFAULT": a CPU without torch's AVX2 uint8 kernels, where bilinear runs in float32."""
    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    if capability != "native":
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    modes = {"nearest": "NEAREST_EXACT", "bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS"}
    rng = np.random.default_rng(7)
    sizes = [((h, w), (th, tw)) for h, w, th, tw in rng.integers(1, 260, (12, 4))]
    sizes += [((97, 61), (97, 61)), ((480, 7), (196, 14))]
    for (h, w), target in sizes:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        batch = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0).contiguous()
        for resample, mode in modes.items():
            want = tvF.resize(batch, list(target), interpolation=InterpolationMode[mode], antialias=True)
            ours = image_mod._resize_torchvision(Image.fromarray(pixels), tuple(target), resample)
            assert ours.shape == (*target, 3) and ours.dtype == np.uint8
            assert np.array_equal(ours, want[0].permute(1, 2, 0).numpy()), (h, w, target, resample)


def test_pillow_simd_fast_path_in_use():
    """bin/setup installs pillow-simd (the same fixed-point arithmetic as torch's uint8 resize kernels,
    ~1.7x faster); its resize must pass the exactness check, or the fast path is never taken."""
    if ".post" not in PIL.__version__:
        skip_or_fail(f"PIL {PIL.__version__} is plain Pillow, not pillow-simd (bin/setup builds it)")
    assert image_mod.pil_resize_matches_torchvision()


def test_pil_resize_stands_in_for_torchvision_only_where_exact(monkeypatch):
    """resize() may run PIL's resampler; it must then give torchvision's exact bytes."""
    rng = np.random.default_rng(5)
    for _ in range(60):
        h, w = rng.integers(1, 300, 2)
        th, tw = rng.integers(1, 400, 2)
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for resample in ("bicubic", "bilinear", "lanczos", "nearest"):
            config = PreprocessConfig(resample=resample)
            want = image_mod._resize_torchvision(im, (th, tw), resample)
            assert np.array_equal(image_mod.resize(im, (th, tw), config), want), (h, w, th, tw, resample)

    # A PIL whose resize rounds differently is caught by the check and never used.
    real = Image.Image.resize
    monkeypatch.setattr(
        Image.Image, "resize", lambda self, *a, **k: real(self, *a, **k).point(lambda v: v ^ 1)
    )
    image_mod._pil_resize_check.cache_clear()
    try:
        assert not image_mod.pil_resize_matches_torchvision()
        im = Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8))
        want = image_mod._resize_torchvision(im, (28, 56), "bicubic")
        assert np.array_equal(image_mod.resize(im, (28, 56), PreprocessConfig()), want)
        monkeypatch.undo()
        monkeypatch.setenv("VLMSERVE_PIL_RESIZE", "0")  # switched off
        image_mod._pil_resize_check.cache_clear()
        assert not image_mod.pil_resize_matches_torchvision()
    finally:
        image_mod._pil_resize_check.cache_clear()


@pytest.mark.parametrize("orientation", [3, 6, 8, 5])
def test_exif_orientation_matches_transposed_reference(orientation, make_image, config, hf_reference):
    data = make_image("jpeg", 400, 240, seed=4, orientation=orientation)
    ours = preprocess(data, config)
    assert_matches(ours, hf_reference(data, config))
    _, gh, gw = ours.grid_thw
    assert (gh > gw) == (orientation >= 5)  # 400x240 stored, upright is portrait for 5-8


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
def test_pil_backend_matches_pil_processor(resample, make_image, hf_reference):
    config = PreprocessConfig(resize_backend="pil", resample=resample)
    for kind, size in [("jpeg", (333, 517)), ("rgba_png", (1000, 60)), ("png", (1024, 768))]:
        data = make_image(kind, *size, seed=5)
        assert_matches(preprocess(data, config), hf_reference(data, config))


def test_custom_mean_std_and_patch_sizes(make_image, hf_reference):
    config = PreprocessConfig(
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
    )
    data = make_image("png", 300, 200, seed=6)
    ours = preprocess(data, config)
    assert_matches(ours, hf_reference(data, config))
    assert ours.patches.shape[1] == 3 * 2 * 16 * 16


def test_visual_token_count_from_header(make_image, config):
    data = make_image("jpeg", 1024, 768)
    grid = plan_grid(probe(data), config, 28 * 28 * 100)
    assert num_visual_tokens(grid, config.merge_size) <= 100
    assert preprocess(data, config, 28 * 28 * 100).patches.shape[0] == grid[1] * grid[2]


def test_draft_keeps_grid_and_stays_close(make_image, config):
    data = make_image("jpeg", 2048, 1536, seed=7)
    budget = 28 * 28 * 64  # target ~252x336: 6x smaller, so draft decodes at 1/4 scale
    exact = preprocess(data, config, budget)
    fast = preprocess(data, config.replace(draft=True), budget)
    assert fast.grid_thw == exact.grid_thw
    diff = np.abs(fast.patches - exact.patches)
    assert 0 < diff.mean() < 0.05  # differs (draft really ran), yet ~1 level of 255 on average


def test_draft_does_nothing_below_2x(make_image, config):
    data = make_image("jpeg", 400, 300, seed=8)  # default budget keeps it ~400x300: no 2x margin
    assert np.array_equal(
        preprocess(data, config.replace(draft=True)).patches, preprocess(data, config).patches
    )


def test_draft_respects_orientation(make_image, config):
    data = make_image("jpeg", 1600, 600, seed=9, orientation=6)
    exact = preprocess(data, config, 28 * 28 * 32)
    fast = preprocess(data, config.replace(draft=True), 28 * 28 * 32)
    assert fast.grid_thw == exact.grid_thw
    assert np.abs(fast.patches - exact.patches).mean() < 0.05


def test_alpha_is_composited_over_white(config):
    # A fully transparent image must come out as white, not as its hidden RGB (black here).
    buf = io.BytesIO()
    Image.new("RGBA", (56, 56), (0, 0, 0, 0)).save(buf, "PNG")
    patches = preprocess(buf.getvalue(), config).patches
    white = (1.0 - np.asarray(config.image_mean, dtype=np.float32)) / np.asarray(config.image_std, np.float32)
    per_channel = patches.reshape(-1, 3, config.temporal_patch_size * config.patch_size**2)
    np.testing.assert_allclose(per_channel[0, :, 0], white, atol=1e-5)
