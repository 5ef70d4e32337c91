"""Video bytes (or a list of frames) → Qwen-VL pixel patches, as transformers' video processors make them.

Steps: ``probe_video`` reads the container and counts the video stream's packets (no decode), checking every
limit; ``plan_video`` picks the frames (each family's ``sample_frames`` rule) and the grid (its smart resize);
``preprocess_video_into`` decodes only the GOPs that hold a picked frame (seeking to their keyframes), resizes
all frames in one torch call, normalizes and writes the two-frame temporal patches into the output buffer.
Probe and plan run where the prompt is built (the grid decides the placeholder count); decoding runs in the
preprocessing pool.

A *frame list* (vLLM's ``data:video/jpeg;base64,<frame>,<frame>,...``) is packed by ``pack_frames`` into one
byte string with a magic prefix, so it is hashed, shipped and decoded like a file; its frames are taken as
already sampled at the request's fps.
"""

from __future__ import annotations

import io
import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from preprocess.errors import (
    CORRUPT,
    EMPTY,
    NO_VIDEO_STREAM,
    TOO_LONG,
    TOO_MANY_BYTES,
    TOO_MANY_FRAMES,
    TOO_MANY_PIXELS,
    UNSUPPORTED_CODEC,
    UNSUPPORTED_FORMAT,
    ZERO_SIZE,
    PreprocessError,
)
from preprocess.grid import smart_resize

FRAMES_MAGIC = b"VLMSERVE-FRAMES\x00"
_FINGERPRINT_SCHEMA = "vlmserve.video.v1"
# NOTE: containers and codecs FFmpeg decodes in its well-trodden paths; anything else (its many rarer demuxers,
# image2 patterns, network protocols) never sees client bytes.
CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi")
CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg", "mpeg1video", "mpeg2video")
FRAME_FORMATS = ("JPEG", "PNG", "WEBP")


@dataclass(frozen=True, slots=True)
class VideoConfig:
    """How a video becomes patches (the family's video processor settings) and what is accepted.

    ``rule``: "qwen2" (Qwen2-VL / Qwen2.5-VL: frame count floored to the temporal patch, ``max_pixels`` per
    frame) or "qwen3" (Qwen3-VL: linspace frames, ``max_pixels`` over all frames together, timestamps).
    """

    rule: str = "qwen2"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    fps: float = 2.0  # frames sampled per second unless the request says otherwise
    min_frames: int = 4
    max_frames: int = 768  # the processor's own bound; the server's is max_sampled_frames
    # -- acceptance limits (server flags) --
    max_bytes: int = 64 * 1024 * 1024
    max_duration_s: float = 600.0
    max_sampled_frames: int = 64
    max_frame_pixels: int = 3840 * 2160  # of a source frame
    max_visual_tokens: int = 16384  # after sampling and resizing, per video
    codecs: tuple[str, ...] = CODECS

    def __post_init__(self) -> None:
        if self.rule not in ("qwen2", "qwen3"):
            raise ValueError(f"video rule must be 'qwen2' or 'qwen3', got {self.rule!r}")
        object.__setattr__(self, "image_mean", tuple(float(x) for x in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(x) for x in self.image_std))
        for name in ("fps", "max_sampled_frames", "max_frame_pixels", "max_visual_tokens", "max_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"video {name} must be positive, got {getattr(self, name)}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def fingerprint(self) -> str:
        """xxh3_128 of what changes pixel values for given frames and grid (the frames picked and the grid
        are in the key itself: see VideoPlan.identity)."""
        canonical = {
            "schema": _FINGERPRINT_SCHEMA,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
        }
        return xxhash.xxh3_128_hexdigest(json.dumps(canonical, sort_keys=True).encode())

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, rule: str, **overrides: Any) -> VideoConfig:
        """transformers' reading: ``video_preprocessor_config.json``, else ``preprocessor_config.json``."""
        path = Path(checkpoint_dir)
        raw: dict = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (path / name).is_file():
                raw = json.loads((path / name).read_text())
                break
        fields: dict[str, Any] = {"rule": rule}
        if rule == "qwen3":  # Qwen3VLVideoProcessor's class defaults
            fields.update(
                patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
            )  # fmt: skip
        for name in ("patch_size", "merge_size", "temporal_patch_size", "rescale_factor", "min_frames"):
            if name in raw:
                fields[name] = raw[name]
        if "max_frames" in raw:
            fields["max_frames"] = raw["max_frames"]
        if raw.get("fps"):
            fields["fps"] = float(raw["fps"])
        for name in ("image_mean", "image_std"):
            if name in raw:
                fields[name] = tuple(raw[name])
        size = raw.get("size") or {}
        lo = raw.get("min_pixels", size.get("shortest_edge"))
        hi = raw.get("max_pixels", size.get("longest_edge"))
        if lo is not None:
            fields["min_pixels"] = int(lo)
        if hi is not None:
            fields["max_pixels"] = int(hi)
        fields.update(overrides)
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What the container says, and the video stream's packets counted (no decode)."""

    width: int
    height: int
    frames: int
    fps: float  # of the source (frame lists: the request's fps)
    codec: str
    frame_list: bool = False

    @property
    def duration(self) -> float:
        return self.frames / self.fps


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """Which source frames, at what size: made where the prompt is built, carried out by a pool worker."""

    indices: tuple[int, ...]
    grid: tuple[int, int, int]
    source_fps: float
    source_frames: int
    timestamps: tuple[float, ...] = field(default=())  # per temporal patch, seconds (Qwen3-VL's prompt text)

    @property
    def size(self) -> tuple[int, int]:
        return self.grid[1], self.grid[2]

    @property
    def sampled_fps(self) -> float:
        """transformers' VideoMetadata.sampled_fps: Qwen2.5-VL's second_per_grid_ts is temporal_patch / this."""
        return len(self.indices) / self.source_frames * self.source_fps

    def identity(self) -> bytes:
        """What, besides the bytes, the embedding depends on: the frames picked (the grid is in the key)."""
        return b"frames:" + ",".join(map(str, self.indices)).encode()


# ---------------------------------------------------------------- frame lists


def pack_frames(frames: list[bytes]) -> bytes:
    """Encoded frames (JPEG/PNG/WEBP bytes) → one byte string that the pool and the hash take like a file."""
    return FRAMES_MAGIC + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def _unpack_frames(data: bytes) -> list[bytes]:
    out, i = [], len(FRAMES_MAGIC)
    while i < len(data):
        if i + 4 > len(data):
            raise PreprocessError(CORRUPT, "frame list is truncated")
        (n,) = struct.unpack_from("<I", data, i)
        if i + 4 + n > len(data):
            raise PreprocessError(CORRUPT, "frame list is truncated")
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def _frame_image(data: bytes, config: VideoConfig):
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FRAME_FORMATS)
    except UnidentifiedImageError:
        raise PreprocessError(
            UNSUPPORTED_FORMAT, "a frame of the list is not a JPEG, PNG or WEBP image"
        ) from None
    except Exception as e:
        raise PreprocessError(CORRUPT, f"a frame of the list is corrupt: {e}") from None
    w, h = im.size
    if w * h > config.max_frame_pixels:
        raise PreprocessError(
            TOO_MANY_PIXELS, f"frame is {w}x{h}, over the limit of {config.max_frame_pixels} pixels per frame"
        )
    return im


# ---------------------------------------------------------------- probe + plan


def probe_video(data: bytes, config: VideoConfig, list_fps: float | None = None) -> VideoInfo:
    """Header and packet-level look (no decode); raises PreprocessError on bad input or a limit passed."""
    if not data:
        raise PreprocessError(EMPTY, "video is empty (0 bytes)")
    if len(data) > config.max_bytes:
        raise PreprocessError(
            TOO_MANY_BYTES, f"video is {len(data)} bytes, over the limit of {config.max_bytes} bytes"
        )
    if data.startswith(FRAMES_MAGIC):
        frames = _unpack_frames(data)
        if not frames:
            raise PreprocessError(EMPTY, "frame list is empty")
        sizes = {_frame_image(f, config).size for f in frames}
        if len(sizes) != 1:
            raise PreprocessError(ZERO_SIZE, f"frames of one video must share one size, got {sorted(sizes)}")
        (w, h), fps = sizes.pop(), float(list_fps or config.fps)
        info = VideoInfo(w, h, len(frames), fps, "image", frame_list=True)
    else:
        info = _probe_container(data, config)
    if info.width <= 0 or info.height <= 0 or info.frames <= 0:
        raise PreprocessError(ZERO_SIZE, f"video has no frames or zero size ({info.width}x{info.height})")
    if info.width * info.height > config.max_frame_pixels:
        raise PreprocessError(
            TOO_MANY_PIXELS,
            f"video frames are {info.width}x{info.height}, over the limit of {config.max_frame_pixels} pixels",
        )
    if info.duration > config.max_duration_s:
        raise PreprocessError(
            TOO_LONG, f"video lasts {info.duration:.1f} s, over the limit of {config.max_duration_s:g} s"
        )
    return info


def _open(data: bytes):
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.error.InvalidDataError:
        if _looks_like_video(data):
            raise PreprocessError(CORRUPT, "video container is truncated or corrupt") from None
        raise PreprocessError(UNSUPPORTED_FORMAT, "not a video file this server reads") from None
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise PreprocessError(CORRUPT, f"video container is truncated or corrupt: {e}") from None


def _looks_like_video(data: bytes) -> bool:
    """The signature of a container we accept (MP4/MOV ftyp or moov, EBML, RIFF AVI)."""
    return (
        data[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free")
        or data.startswith(b"\x1a\x45\xdf\xa3")
        or (data.startswith(b"RIFF") and data[8:12] == b"AVI ")
    )


def _video_stream(container, config: VideoConfig):
    if container.format.name not in CONTAINERS:
        raise PreprocessError(
            UNSUPPORTED_FORMAT,
            f"video container {container.format.name!r} is not accepted (MP4/MOV, WebM/MKV, AVI)",
        )
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise PreprocessError(NO_VIDEO_STREAM, f"the file has no video stream (streams: {', '.join(kinds)})")
    stream = container.streams.video[0]
    codec = stream.codec_context.name if stream.codec_context else ""
    if codec not in config.codecs:
        raise PreprocessError(
            UNSUPPORTED_CODEC,
            f"video codec {codec or 'unknown'!r} is not accepted ({', '.join(config.codecs)})",
        )
    return stream


def _packets(container, stream) -> list[tuple[int, bool]]:
    """(pts, keyframe) of each of the stream's packets in decode order (demux only, no decode)."""
    import av

    out = []
    try:
        for packet in container.demux(stream):
            if packet.size and packet.pts is not None:
                out.append((int(packet.pts), bool(packet.is_keyframe)))
    except av.error.FFmpegError as e:
        raise PreprocessError(CORRUPT, f"video data is truncated or corrupt: {e}") from None
    return out


def _probe_container(data: bytes, config: VideoConfig) -> VideoInfo:
    with _open(data) as container:
        stream = _video_stream(container, config)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        width, height = stream.codec_context.width, stream.codec_context.height
        if fps <= 0:
            raise PreprocessError(CORRUPT, "video stream has no frame rate")
        # NOTE: counted, not read from the header (WebM has none, and a header can say anything); bounded by
        # max_bytes. Checked against the duration limit before any decode.
        frames = len(_packets(container, stream))
        if frames == 0:
            raise PreprocessError(ZERO_SIZE, "video stream has no frames")
        return VideoInfo(width, height, frames, fps, stream.codec_context.name)


def sample_indices(
    config: VideoConfig,
    total: int,
    source_fps: float,
    fps: float | None = None,
    max_frames: int | None = None,
) -> list[int]:
    """The family's ``sample_frames`` rule (transformers' Qwen2VL/Qwen3VL video processors), with the server's
    frame bound folded into ``max_frames``."""
    import torch

    fps = config.fps if fps is None else fps
    cap = min(config.max_frames, config.max_sampled_frames, max_frames or config.max_sampled_frames)
    tp = config.temporal_patch_size
    if config.rule == "qwen3":
        n = int(total / source_fps * fps)
        n = min(max(n, config.min_frames), cap, total)
        return np.linspace(0, total - 1, n).round().astype(int).tolist()
    hi = math.floor(min(cap, total) / tp) * tp
    n = total / source_fps * fps
    n = math.floor(min(max(n, config.min_frames), hi, total) / tp) * tp
    if n <= 0:  # fewer frames than one temporal patch: all of them (padded), where transformers refuses
        return list(range(min(total, cap)))
    return torch.arange(0, total, total / n).int().tolist()


def smart_resize_video(
    config: VideoConfig, frames: int, height: int, width: int, max_pixels: int
) -> tuple[int, int]:
    if config.rule == "qwen2":
        return smart_resize(height, width, config.factor, config.min_pixels, max_pixels)
    # Qwen3-VL's: the budget covers all frames; small frames are first scaled up to one factor.
    factor, tf = config.factor, config.temporal_patch_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h, w = smart_resize(height, width, factor, 1, 1 << 62)  # the aspect check and the rounding only
    t = round(frames / tf) * tf
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def plan_video(
    info: VideoInfo,
    config: VideoConfig,
    fps: float | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = None,
    pixels_scale: float = 1.0,
) -> VideoPlan:
    """Frames and grid for a probed video; per-request ``fps``/``max_frames``/``max_pixels`` within the config's.
    ``pixels_scale`` (the video ladder's) scales the pixels the frames would get at full budget."""
    if max_frames is not None and max_frames > config.max_sampled_frames:
        raise PreprocessError(
            TOO_MANY_FRAMES,
            f"max_frames {max_frames} is over this server's limit of {config.max_sampled_frames}",
        )
    if info.frame_list:
        if info.frames > config.max_sampled_frames:
            raise PreprocessError(
                TOO_MANY_FRAMES,
                f"the frame list has {info.frames} frames, over this server's limit of {config.max_sampled_frames}",
            )
        n = min(info.frames, max_frames or info.frames)
        indices = np.linspace(0, info.frames - 1, n).round().astype(int).tolist()
    else:
        indices = sample_indices(config, info.frames, info.fps, fps, max_frames)
    budget = config.max_pixels if max_pixels is None else min(max_pixels, config.max_pixels)
    if pixels_scale != 1.0:
        h, w = smart_resize_video(config, len(indices), info.height, info.width, budget)
        frames = len(indices) if config.rule == "qwen3" else 1  # Qwen3-VL's budget covers every frame
        budget = max(config.min_pixels, int(h * w * frames * pixels_scale))
    h, w = smart_resize_video(config, len(indices), info.height, info.width, budget)
    tp = config.temporal_patch_size
    grid = (-(-len(indices) // tp), h // config.patch_size, w // config.patch_size)
    tokens = grid[0] * grid[1] * grid[2] // config.merge_size**2
    if tokens > config.max_visual_tokens:
        raise PreprocessError(
            TOO_MANY_PIXELS,
            f"video would take {tokens} visual tokens ({len(indices)} frames at {w}x{h}), over the limit of "
            f"{config.max_visual_tokens}: ask for fewer frames or fewer pixels",
        )
    # Qwen3-VL's _calculate_timestamps: each temporal patch at the mean time of its first and last frame.
    padded = indices + [indices[-1]] * (-len(indices) % tp)
    stamps = [(padded[i] / info.fps + padded[i + tp - 1] / info.fps) / 2 for i in range(0, len(padded), tp)]
    return VideoPlan(tuple(indices), grid, info.fps, info.frames, tuple(stamps))


# ---------------------------------------------------------------- decode + patchify


def decode_frames(data: bytes, plan: VideoPlan, config: VideoConfig, size: tuple[int, int] | None = None):
    """The plan's frames in the plan's order (a repeated index repeats its frame): RGB uint8 [n, H, W, 3], or
    with ``size`` (h, w) each frame resized as soon as it is decoded (a [n, 3, h, w] uint8 tensor), so a long
    clip of large frames never sits in memory whole."""
    keep = (lambda a: a) if size is None else (lambda a: resize_frames(a[None], size)[0])
    if data.startswith(FRAMES_MAGIC):
        frames = _unpack_frames(data)
        got, shape = {}, None
        for i in sorted(set(plan.indices)):
            im = _frame_image(frames[i], config)
            try:
                rgb = np.asarray(im.convert("RGB"))
            except Exception as e:
                raise PreprocessError(
                    CORRUPT, f"frame {i} of the list is truncated or corrupt: {e}"
                ) from None
            if rgb.shape != (shape := shape or rgb.shape):
                raise PreprocessError(ZERO_SIZE, "frames of one video must share one size")
            got[i] = keep(rgb)
    else:
        with _open(data) as container:
            stream = _video_stream(container, config)
            packets = _packets(container, stream)
            got = _decode_picked(container, stream, packets, sorted(set(plan.indices)), keep)
    missing = [i for i in plan.indices if i not in got]
    if missing:
        raise PreprocessError(
            CORRUPT,
            f"video is truncated or corrupt: {len(missing)} of {len(plan.indices)} frames did not decode",
        )
    picked = [got[i] for i in plan.indices]
    if size is None:
        return np.stack(picked)
    import torch

    return torch.stack(picked)


def _decode_picked(container, stream, packets: list[tuple[int, bool]], wanted: list[int], keep) -> dict:
    """Decode only the GOPs holding a wanted frame (by presentation index): seek to a GOP's keyframe when the
    decoder is not already inside it, stop once the last wanted frame is out."""
    import av

    order = sorted(p for p, _ in packets)  # presentation index → pts
    keys = sorted(p for p, k in packets if k)
    by_pts = {order[i]: i for i in wanted if i < len(order)}
    got: dict[int, np.ndarray] = {}
    if not by_pts:
        return got
    stream.thread_type = "AUTO"
    last = max(by_pts)
    frames = None
    position = -1  # pts of the last frame decoded
    try:
        for pts in sorted(by_pts):
            if pts in got or by_pts[pts] in got:
                continue
            kf = max((k for k in keys if k <= pts), default=None)
            if frames is None or (kf is not None and kf > position and pts > position):
                container.seek(kf if kf is not None else 0, stream=stream, backward=True, any_frame=False)
                frames = container.decode(stream)
            for frame in frames:
                fp = frame.pts if frame.pts is not None else position + 1
                position = fp
                if fp in by_pts and by_pts[fp] not in got:
                    got[by_pts[fp]] = keep(frame.to_ndarray(format="rgb24"))
                if fp >= pts:
                    break
            if position >= last:
                break
    except av.error.FFmpegError as e:
        raise PreprocessError(CORRUPT, f"video data is truncated or corrupt: {e}") from None
    return got


def resize_frames(frames: np.ndarray, size: tuple[int, int]):
    """torchvision's ``resize`` of a uint8 [n, 3, H, W] batch (bicubic, antialias), as transformers' video
    processors call it: a float32-free uint8 path, identical for each frame to the image path's."""
    import torch
    from torch.nn import functional as F

    batch = torch.from_numpy(np.require(frames, requirements=["C", "W"])).permute(0, 3, 1, 2).contiguous()
    if tuple(batch.shape[-2:]) == tuple(size):
        return batch
    return F.interpolate(batch, size=list(size), mode="bicubic", align_corners=False, antialias=True)


def patchify_frames(video, config: VideoConfig, out: np.ndarray) -> None:
    """Normalized [n, 3, H, W] uint8 → ``out`` [grid_t·gh·gw, C·T·p·p] in transformers' patch order, the last
    frame repeated up to a whole temporal patch."""
    import torch

    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    inv = np.float32(1.0 / config.rescale_factor)
    mean = torch.from_numpy(np.asarray(config.image_mean, dtype=np.float32) * inv).view(1, 3, 1, 1)
    std = torch.from_numpy(np.asarray(config.image_std, dtype=np.float32) * inv).view(1, 3, 1, 1)
    if pad := -video.shape[0] % tp:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    n, c, h, w = video.shape
    gt, gh, gw = n // tp, h // p, w // p
    x = video.view(gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    target = torch.from_numpy(out).view(gt, gh // m, gw // m, m, m, c, tp, p, p)
    # NOTE: transformers' fused rescale + normalize: float32 (x - mean·255) / (std·255).
    torch.sub(x.float(), mean.view(1, 1, 1, 1, 1, 3, 1, 1, 1), out=target)
    target.div_(std.view(1, 1, 1, 1, 1, 3, 1, 1, 1))


@dataclass(frozen=True, slots=True)
class VideoJob:
    """What a pool worker needs besides the bytes: the settings and the plan (and, for the usage report, the video
    ladder level the plan was made at)."""

    config: VideoConfig
    plan: VideoPlan
    level: int = 0


def preprocess_video_into(
    data: bytes, config: VideoConfig, plan: VideoPlan, alloc
) -> tuple[np.ndarray, tuple]:
    """Decode the plan's frames, resize, normalize, patchify into ``alloc(shape)``: (patches, grid)."""
    gt, gh, gw = plan.grid
    video = decode_frames(data, plan, config, (gh * config.patch_size, gw * config.patch_size))
    out = alloc((gt * gh * gw, config.patch_dim))
    patchify_frames(video, config, out)
    return out, plan.grid


def preprocess_video(data: bytes, config: VideoConfig, plan: VideoPlan) -> tuple[np.ndarray, tuple]:
    return preprocess_video_into(data, config, plan, lambda shape: np.empty(shape, dtype=np.float32))
