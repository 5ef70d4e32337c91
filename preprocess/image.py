"""Image bytes → Qwen2-VL pixel patches, numerically the same as transformers' Qwen2VLImageProcessor.

Steps: lazy open and limit checks (probe.py), plan the grid from the header, decode (optionally
in JPEG draft mode), EXIF-orient, convert to RGB, resize to the grid, rescale + normalize and
patchify straight into the output buffer (which the pool places in shared memory).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from preprocess.config import PreprocessConfig
from preprocess.errors import CORRUPT, DECOMPRESSION_BOMB, PreprocessError
from preprocess.grid import plan_grid
from preprocess.probe import ImageInfo, open_image
from runtime.native import load_library, switched_off

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
_BAND_PATCHES = 512  # the numpy path's work unit: 512 x 588 float32 = 1.2 MB of scratch
_KERNEL_SOURCE = Path(__file__).parent / "csrc" / "patchify.c"

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
    return preprocess_into(data, config, max_pixels, _new_array)


def preprocess_into(
    data: bytes, config: PreprocessConfig, max_pixels: int | None, alloc: Allocator
) -> PixelPatches:
    """preprocess(), writing the patches into `alloc(shape)` (float32, C-contiguous)."""
    im, info = open_image(data, config)
    grid = plan_grid(info, config, max_pixels)
    rgb = decode_rgb(im, info, config, _target_size(grid, config))
    return _patches(rgb, grid, config, alloc)


def preprocess_picture(
    rgb: Image.Image, config: PreprocessConfig, max_pixels: int | None = None
) -> PixelPatches:
    """preprocess() of a picture already in memory (RGB, upright), which is what a lossless file of it (PNG)
    decodes to: the same grid, resize and patches, without encoding and decoding it. No limit checks: the
    caller made the picture (``vlmserve train-demo`` draws its own)."""
    if rgb.mode != "RGB":
        raise ValueError(f"preprocess_picture takes an RGB picture, not {rgb.mode}")
    w, h = rgb.size
    grid = plan_grid(ImageInfo(width=w, height=h, format="", orientation=1, mode="RGB"), config, max_pixels)
    return _patches(rgb, grid, config, _new_array)


def _new_array(shape: tuple[int, int]) -> np.ndarray:
    """The allocator of preprocess() and preprocess_picture(): a fresh float32 array."""
    return np.empty(shape, dtype=np.float32)


def _target_size(grid: tuple[int, int, int], config: PreprocessConfig) -> tuple[int, int]:
    return grid[1] * config.patch_size, grid[2] * config.patch_size


def _patches(
    rgb: Image.Image, grid: tuple[int, int, int], config: PreprocessConfig, alloc: Allocator
) -> PixelPatches:
    resized = resize(rgb, _target_size(grid, config), config)
    out = alloc((grid[1] * grid[2], config.patch_dim))
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
    """Resize to `size` (h, w); returns uint8 [h, w, 3] (C-contiguous, or a view of it)."""
    if config.resize_backend == "pil" or (
        config.resample in _PIL_EXACT_MODES and pil_resize_matches_torchvision()
    ):
        h, w = size
        if rgb.size != (w, h):
            rgb = rgb.resize((w, h), _PIL_FILTERS[config.resample])
        return np.asarray(rgb)
    return _resize_torchvision(rgb, size, config.resample)


# Where PIL's resize can stand in for torchvision's (see pil_resize_matches_torchvision); torch's
# NEAREST_EXACT is not PIL's NEAREST.
_PIL_EXACT_MODES = ("bilinear", "bicubic", "lanczos")


# Set in preprocess worker processes to their parent's verdict (see pil_resize_matches_torchvision), so that
# a worker need not import torch to settle it.
_PIL_VERDICT: bool | None = None


def trust_pil_resize(verdict: bool) -> None:
    """Take ``verdict`` as this process's pil_resize_matches_torchvision() (a worker, from its parent)."""
    global _PIL_VERDICT
    _PIL_VERDICT = bool(verdict)


def pil_resize_matches_torchvision() -> bool:
    """Whether the installed PIL resizes RGB to the same bytes as torch's antialiased uint8 kernels.

    pillow-simd does: torch's uint8 antialias path is a port of its fixed-point separable resampler
    (600 random noise images, up- and downscaled, matched bit for bit in each of bilinear, bicubic
    and lanczos) and runs ~1.7x faster (the benchmark mix, one thread: 15.2 vs 25.4 ms). Other PIL
    builds may round differently, so this checks once per process, on noise images where any
    rounding difference shows, and resize() keeps torchvision unless they agree. A preprocess worker
    takes its parent's verdict instead (trust_pil_resize): the check needs torch, the PIL path does not,
    so a worker imports torch only if it has to resize with it.
    """
    if _PIL_VERDICT is not None:
        return _PIL_VERDICT
    return _pil_resize_check()


@functools.cache
def _pil_resize_check() -> bool:
    if switched_off("VLMSERVE_PIL_RESIZE"):
        return False
    rng = np.random.default_rng(20261201)
    cases = [((37, 53), (28, 84)), ((211, 149), (56, 28)), ((29, 31), (112, 140)), ((480, 7), (196, 14))]
    for (h, w), target in cases:
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for mode in _PIL_EXACT_MODES:
            ours = np.asarray(im.resize(target[::-1], _PIL_FILTERS[mode]))
            if not np.array_equal(ours, _resize_torchvision(im, target, mode)):
                return False
    return True


def _resize_torchvision(rgb: Image.Image, size: tuple[int, int], resample: str) -> np.ndarray:
    """torchvision's ``resize`` of a uint8 [1, 3, H, W] CPU tensor (``antialias=True``), as transformers'
    TorchvisionBackend calls it, without importing torchvision.

    NOTE: importing ``torchvision.transforms.v2`` imports ``torchvision.models`` and with it
    ``torch._dynamo`` (~2.8 s of CPU on a 2-core EPYC), in every process that preprocesses. The call
    itself is a thin rule over ``F.interpolate``, restated here (torchvision 0.29's ``resize_image``):
    bicubic and lanczos interpolate uint8 natively; bilinear does where torch's CPU kernels have the
    AVX2/AVX-512 uint8 path (or on arm64), else runs in float32 and rounds; nearest-exact has no
    antialias. tests/preprocess compare it with torchvision bit for bit and with transformers.
    """
    import torch
    from torch.nn import functional as F

    mode = _TORCH_MODES[resample]
    h, w = size
    # NOTE: PIL's HWC buffer as a channels-last view of transformers' contiguous [1, C, H, W] uint8
    # batch: torch's uint8 kernels (the AVX2 one and the generic separable one) run the same integer
    # arithmetic per output value for either layout, so the output is bit-identical, and
    # channels-last skips a 1-byte-strided transpose and torch's internal RGB unpack/repack: ~4x
    # faster on 2048x1536.
    batch = _tensor_view(np.asarray(rgb)).permute(2, 0, 1).unsqueeze(0)
    if (h, w) == tuple(batch.shape[-2:]):
        return np.asarray(rgb)
    if mode == "nearest-exact":
        return F.interpolate(batch, size=[h, w], mode=mode)[0].permute(1, 2, 0).numpy()
    native = mode != "bilinear" or (
        torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        or platform.machine() in ("aarch64", "arm64")
    )
    x = batch if native else batch.float()
    out = F.interpolate(x, size=[h, w], mode=mode, align_corners=False, antialias=True)
    if not native:
        out = out.round_().to(torch.uint8)  # bilinear stays within [0, 255]: no clamp, as torchvision
    return out[0].permute(1, 2, 0).numpy()


_TORCH_MODES = {
    "nearest": "nearest-exact",
    "bilinear": "bilinear",
    "bicubic": "bicubic",
    "lanczos": "lanczos",
}


def _tensor_view(array: np.ndarray):
    """torch.from_numpy without a copy, also of a read-only array (np.asarray of a PIL image is
    one: its buffer is a bytes object). Nothing writes to the tensor; a writable copy would cost
    more than the resize on a 2048x1536 image."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(array)


def normalize_patchify(hwc: np.ndarray, config: PreprocessConfig, out: np.ndarray) -> None:
    """(x - mean/rescale) / (std/rescale) in float32, written in transformers' patch order.

    hwc: uint8 [h, w, 3]. out: [grid_h * grid_w, 3 * T * p * p]; rows run over merge windows
    (row-major), then the m x m patches inside a window; each row is (channel, temporal copy,
    patch row, patch col). Runs the compiled kernel (csrc/patchify.c, ~3x faster) where it builds,
    else the numpy path; both give the same bits.
    """
    kernel = _patchify_kernel()
    if kernel is None:
        _normalize_patchify_numpy(hwc, config, out)
        return
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    if hwc.dtype != np.uint8 or hwc.ndim != 3 or hwc.shape[2] != 3:
        raise ValueError(f"normalize_patchify needs uint8 [h, w, 3] pixels, got {hwc.dtype} {hwc.shape}")
    h, w, _ = hwc.shape
    # NOTE: the kernel trusts `out` to hold every row it writes; checked here, it cannot check it.
    rows = (h // p) * (w // p)
    if out.shape != (rows, config.patch_dim) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"normalize_patchify needs float32 C-contiguous [{rows}, {config.patch_dim}] output")
    if not out.flags.writeable:
        raise ValueError("normalize_patchify's output is read-only")
    if hwc.strides[1:] != (3, 1) or hwc.strides[0] < 3 * w:
        hwc = np.ascontiguousarray(hwc)  # resize() never returns such a view: both backends give packed rows
    mean, std = _scaled_mean_std(config)
    rc = kernel(
        hwc.ctypes.data, h, w, hwc.strides[0], p, m, t, mean.ctypes.data, std.ctypes.data, out.ctypes.data
    )
    if rc != 0:
        raise ValueError(
            f"normalize_patchify kernel refused a {h}x{w} image with patch {p}, merge {m}, temporal {t} "
            f"(code {rc}): the sides must be multiples of patch x merge, at most 2**20"
        )


@functools.cache
def _patchify_kernel() -> Callable[..., int] | None:
    """vlm_normalize_patchify from csrc/patchify.c, or None (no compiler, VLMSERVE_CPU_KERNELS=0).

    NOTE: lazy, so nothing is built when the pool's forkserver imports this module; workers call it
    while warming up (the build is cached on disk).
    """
    lib = load_library(_KERNEL_SOURCE)
    if lib is None:
        return None
    fn = lib.vlm_normalize_patchify
    fn.restype = ctypes.c_int
    # src, h, w, row_stride (bytes), patch, merge, temporal, mean[3], std[3], out
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 3
    return fn


def _scaled_mean_std(config: PreprocessConfig) -> tuple[np.ndarray, np.ndarray]:
    # NOTE: rescale folded into mean/std exactly as transformers' fused path (float32 mean * 255,
    # then float32 subtract and divide; IEEE division, so any vectorisation rounds the same), so
    # the values match bit for bit rather than to ~1e-7.
    inv = np.float32(1.0 / config.rescale_factor)
    mean = np.asarray(config.image_mean, dtype=np.float32) * inv
    std = np.asarray(config.image_std, dtype=np.float32) * inv
    return mean, std


def _normalize_patchify_numpy(hwc: np.ndarray, config: PreprocessConfig, out: np.ndarray) -> None:
    """normalize_patchify without the compiled kernel: numpy gathers, torch normalizes."""
    import torch

    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    h, w, c = hwc.shape
    gh, gw = h // p, w // p
    scaled_mean, scaled_std = _scaled_mean_std(config)
    mean = torch.from_numpy(scaled_mean).view(1, c, 1, 1)
    std = torch.from_numpy(scaled_std).view(1, c, 1, 1)
    # A band of k merge-window rows is a contiguous range of output rows. Per band: gather the
    # uint8 pixels into patch order (1 byte per value, so the strided gather is cheap), normalize
    # them in float32, then one copy that also repeats each patch over the T axis. Bands of
    # ~_BAND_PATCHES keep the float scratch in L2, so memory sees little more than the output.
    per_row = (gw // m) * m * m
    k = max(1, min(gh // m, _BAND_PATCHES // per_row))
    windows = hwc.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)
    pixels = np.empty((k, gw // m, m, m, c, p, p), dtype=np.uint8)
    pixels_t = torch.from_numpy(pixels).view(k * per_row, c, 1, p * p)
    values = torch.empty((k * per_row, c, 1, p * p), dtype=torch.float32)
    rows = out.reshape(gh * gw, c, t, p * p)
    for r0 in range(0, gh // m, k):
        r1 = min(gh // m, r0 + k)
        n = (r1 - r0) * per_row
        np.copyto(pixels[: r1 - r0], windows[r0:r1])
        torch.sub(pixels_t[:n], mean, out=values[:n]).div_(std)
        np.copyto(rows[r0 * per_row : r0 * per_row + n], values[:n].numpy())
