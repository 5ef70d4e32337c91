"""Chat messages → prompt token ids, image items and M-RoPE positions (the model family's rules)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image
from tokenizers import Tokenizer

from cache import EmbeddingKey
from lm_engine.models.qwen2_vl import mrope_positions
from lm_engine.models.registry import ModelConfig
from lm_engine.sequence import ImageItem
from lm_engine.tool_prompt import has_tool_turns, with_tools
from lm_engine.visual_budget import VideoBudget
from preprocess import PreprocessConfig, PreprocessError, image_hash, num_visual_tokens, plan_grid, probe
from preprocess.hashing import DEFAULT_HASH, check_algorithm
from preprocess.video import VideoConfig, VideoJob, VideoPlan, pack_frames, plan_video, probe_video

_VIDEO_PARTS = ("video", "video_url")
# vLLM's frame list: data:video/jpeg;base64,<frame>,<frame>,... (also png, webp)
_FRAME_LIST_TYPES = ("data:video/jpeg;base64,", "data:video/png;base64,", "data:video/webp;base64,")


class InputError(ValueError):
    """The request's messages or media cannot be turned into a prompt (a client error)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True)
class ImageInput:
    """An image part of a chat message: where its bytes come from, and the ``detail`` it asked for."""

    source: bytes | str | Image.Image  # the bytes, a URL (data:, http(s):, file:) or a PIL image
    detail: str | None = None


@dataclass(slots=True)
class VideoInput:
    """A video part: its bytes (a file, or frames packed by ``pack_frames``) or URL, and its sampling asks."""

    source: bytes | str  # the bytes, a URL (data:, http(s):, file:), or packed frames
    fps: float | None = None
    max_frames: int | None = None
    max_pixels: int | None = None
    detail: str | None = None


@dataclass(slots=True)
class ChatInput:
    """Chat messages normalized: for the template, image parts reduced to ``{"type": "image"}`` and video parts
    to ``{"type": "video"}``; the parts themselves in prompt order."""

    messages: list[dict]
    images: list[ImageInput]
    tools: list[dict] | None = None  # OpenAI tool objects the prompt offers the model (None: none)
    videos: list[VideoInput] = field(default_factory=list)


@dataclass(slots=True)
class PromptInputs:
    token_ids: list[int]
    images: list[ImageItem]
    positions: torch.Tensor
    position_delta: int
    image_data: dict[EmbeddingKey, bytes]  # each image's encoded bytes, for the encoder


def _load_chat_template(path: Path) -> str:
    for name in ("chat_template.jinja",):
        if (path / name).is_file():
            return (path / name).read_text()
    for name in ("chat_template.json", "tokenizer_config.json", "processor_config.json"):
        f = path / name
        if f.is_file():
            template = json.loads(f.read_text()).get("chat_template")
            if isinstance(template, str):
                return template
    raise FileNotFoundError(
        f"checkpoint {path} has no chat template (chat_template.jinja/.json or tokenizer_config.json)"
    )


def _span_grid(item: ImageItem, merge: int) -> tuple[int, int, int]:
    """The patch grid an item's span covers: a Qwen3-VL video span is one temporal patch of its video."""
    t, h, w = item.grid
    return (1, h, w) if item.video is not None and item.length < t * h * w // merge**2 else item.grid


def _raise(message: str) -> None:
    raise InputError(f"chat template: {message}")


def decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise InputError("malformed data: URL", param="image_url")
    if not header.endswith(";base64"):
        raise InputError("only base64 data: URLs are supported", param="image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"data: URL is not valid base64 ({exc})", param="image_url") from None


def _image_source(part: dict) -> bytes | str | Image.Image:
    if part.get("type") == "image":
        img = part.get("image")
        if isinstance(img, (bytes, bytearray, memoryview)):
            return bytes(img)
        if isinstance(img, (Image.Image, str)):
            return img
        raise InputError("image part must carry bytes, a PIL image or a URL", param="image")
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise InputError("image_url part needs a url", param="image_url")
    return url


def _image_detail(part: dict) -> str | None:
    spec = part.get("image_url")
    detail = spec.get("detail") if isinstance(spec, dict) else None
    detail = detail or part.get("detail")
    if detail not in (None, "auto", "low", "high"):
        raise InputError(f"detail must be 'auto', 'low' or 'high', got {detail!r}", param="detail")
    return detail


def decode_frame_list(url: str) -> bytes:
    """vLLM's ``data:video/jpeg;base64,<frame>,<frame>,...`` → the frames packed (preprocess.video)."""
    payload = url.partition(",")[2]
    try:
        frames = [base64.b64decode(f, validate=True) for f in payload.split(",")]
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"a frame of the data: URL is not valid base64 ({exc})", param="video_url") from None
    return pack_frames(frames)


def _number(spec: dict, name: str, kind: type, low: float) -> float | int | None:
    value = spec.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low or value != value:
        raise InputError(f"video_url.{name} must be a number >= {low}, got {value!r}", param=name)
    if kind is int and value != int(value):
        raise InputError(f"video_url.{name} must be an integer, got {value!r}", param=name)
    return kind(value)


def _video_input(part: dict) -> VideoInput:
    if part.get("type") == "video":
        src = part.get("video")
        if isinstance(src, (list, tuple)) and src and all(isinstance(f, (bytes, bytearray)) for f in src):
            src = pack_frames([bytes(f) for f in src])
        elif isinstance(src, (bytes, bytearray, memoryview)):
            src = bytes(src)
        if not isinstance(src, (bytes, str)) or not src:
            raise InputError("video part must carry bytes, a list of frame bytes or a URL", param="video")
        spec = part
    else:
        spec = part.get("video_url")
        spec = spec if isinstance(spec, dict) else {"url": spec}
        src = spec.get("url")
        if not isinstance(src, str) or not src:
            raise InputError("video_url part needs a url", param="video_url")
    detail = spec.get("detail") or part.get("detail")
    if detail not in (None, "auto", "low", "high"):
        raise InputError(f"detail must be 'auto', 'low' or 'high', got {detail!r}", param="detail")
    return VideoInput(
        src,
        fps=_number(spec, "fps", float, 0.01),
        max_frames=_number(spec, "max_frames", int, 1),
        max_pixels=_number(spec, "max_pixels", int, 1),
        detail=detail,
    )


def normalize_messages(messages: list[dict]) -> ChatInput:
    """OpenAI-style messages (text, ``image_url`` and ``image`` parts) → the one form every entry point uses
    (the server, ``vlmserve batch`` and the offline ``LLM``)."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list", param="messages")
    out, images, videos = [], [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise InputError(f"messages[{i}] must be an object with a role", param="messages")
        content = msg.get("content")
        if content is None and msg["role"] != "assistant":
            raise InputError(f"messages[{i}].content must not be null", param="messages")
        calls = {k: msg[k] for k in ("tool_calls", "tool_call_id") if msg.get(k) is not None}
        if content is None or isinstance(content, str):
            out.append({"role": msg["role"], "content": content or "", **calls})
            continue
        if not isinstance(content, list):
            raise InputError(f"messages[{i}].content must be a string or a list of parts", param="messages")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind in ("image_url", "image"):
                images.append(ImageInput(_image_source(part), _image_detail(part)))
                parts.append({"type": "image"})
            elif kind in _VIDEO_PARTS:
                videos.append(_video_input(part))
                parts.append({"type": "video"})
            else:
                raise InputError(f"messages[{i}]: unsupported content part type {kind!r}", param="messages")
        out.append({"role": msg["role"], "content": parts, **calls})
    return ChatInput(out, images, videos=videos)


def _parsed_arguments(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects, as the Qwen templates print them (``tojson``);
    OpenAI sends them as JSON text."""
    out = []
    for msg in messages:
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                fn = dict(call.get("function", {}))
                with contextlib.suppress(TypeError, ValueError):
                    fn["arguments"] = json.loads(fn.get("arguments", "{}"))
                calls.append({**call, "function": fn})
            msg = {**msg, "tool_calls": calls}
        out.append(msg)
    return out


def _text_chars(messages: list[dict]) -> int:
    total = 0
    for msg in messages:
        content = msg["content"]
        if isinstance(content, str):
            total += len(content)
        else:
            total += sum(len(p.get("text", "")) for p in content)
    return total


def _offline_bytes(source: bytes | str | Image.Image) -> bytes | Image.Image:
    """An image's bytes where no fetching is allowed (the offline API): bytes, PIL images, data: URLs."""
    if not isinstance(source, str):
        return source
    if source.startswith(_FRAME_LIST_TYPES):
        return decode_frame_list(source)
    if source.startswith("data:"):
        return decode_data_url(source)
    raise InputError(
        f"unsupported image URL scheme in offline use: {source[:32]!r} (pass bytes or a data: URL)",
        param="image_url",
    )


_PNG_MODES = {"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"}


def encode_pil(img: Image.Image) -> bytes:
    """A PIL image handed to the offline API, as lossless PNG bytes for the same pipeline as uploads."""
    if img.mode not in _PNG_MODES:
        img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class InputProcessor:
    """Chat template + tokenizer + image grid planning. Images are only probed here (header, no decode):
    decoding, resizing and encoding happen in the vision pipeline, and not at all on a cache hit."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        preprocess_config: PreprocessConfig,
        hash_algorithm: str = DEFAULT_HASH,
        video_config: VideoConfig | None = None,
    ) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no tokenizer.json")
        self.cfg = cfg
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        source = _load_chat_template(path)
        self.template = env.from_string(source)
        # A template that reads `tools` renders them (and tool turns) its own way; others get tool_prompt's.
        self.template_has_tools = "tools" in source
        self.preprocess_config = preprocess_config
        self.preprocess_fingerprint = preprocess_config.fingerprint()
        self.model_fingerprint = ""  # set once the vision weights are loaded
        self.hash_algorithm = check_algorithm(hash_algorithm)  # of image identity and embedding keys
        self.merge = cfg.spatial_merge_size
        # Qwen3-VL writes a timestamp before each temporal patch; Qwen2.5-VL spaces them in M-RoPE by time.
        self.timestamps = getattr(cfg, "deepstack_levels", None) is not None
        self.video_config = video_config or VideoConfig.from_checkpoint(
            path, "qwen3" if self.timestamps else "qwen2"
        )
        self.video_fingerprint = self.video_config.fingerprint()
        tps = cfg.vision.get("tokens_per_second") if cfg.raw.get("model_type") == "qwen2_5_vl" else None
        self.tokens_per_second = float(tps) if tps else None
        self.max_prompt_tokens = 0  # set by the engine once the context is known; 0: no early bound
        self.longest_token = max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True))

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if self.template_has_tools:
            return self.template.render(
                messages=_parsed_arguments(messages), tools=tools, add_generation_prompt=True
            )
        if tools or has_tool_turns(messages):
            messages = with_tools(messages, tools)
        return self.template.render(messages=messages, add_generation_prompt=True)

    def process_chat(
        self,
        chat: ChatInput | list[dict],
        budget: Callable[[str | None], int | None] | None = None,
        cache_salt: str = "",
        video_budget: Callable[[str | None], VideoBudget] | None = None,
    ) -> PromptInputs:
        """Messages (or their normalized form, image sources already fetched) → the prompt.
        ``budget(detail)``: the max_pixels an image with that OpenAI ``detail`` gets (None: the config's).
        ``cache_salt``: the request's salt; its images' embeddings are shared only with the same salt."""
        if not isinstance(chat, ChatInput):
            chat = normalize_messages(chat)
        # NOTE: no token is longer than the longest in the vocabulary, so text this long cannot fit the
        # context: refused before the template and the tokenizer spend seconds on it.
        if (
            self.max_prompt_tokens
            and _text_chars(chat.messages) > self.max_prompt_tokens * self.longest_token
        ):
            raise InputError(
                f"the messages are far longer than this model's context of {self.max_prompt_tokens} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        items, data = [], {}
        for i, image in enumerate(chat.images):
            item, data_i = self.process_image(
                _offline_bytes(image.source), budget(image.detail) if budget else None, i, cache_salt
            )
            items.append(item)
            data[item.key] = data_i
        videos = []
        for i, video in enumerate(chat.videos):
            item, data_i = self.process_video(
                video, i, cache_salt, video_budget(video.detail) if video_budget else None
            )
            videos.append(item)
            data[item.key] = data_i
        text = self.render(chat.messages, chat.tools)
        if self.timestamps and videos:
            text = self._timestamped(text, videos)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        pad, vpad = self.cfg.image_token_id, self.cfg.video_token_id
        spans = [s for v in videos for s in self._video_spans(v)]
        if ids.count(pad) != len(chat.images) or ids.count(vpad) != len(spans):
            raise InputError("the number of image or video placeholders does not match the images and videos")
        token_ids: list[int] = []
        placed, where = [], []
        pending = {pad: iter(items), vpad: iter(spans)}
        for tok in ids:
            if tok in (pad, vpad):
                item, interval = next(pending[tok]), 1
                if isinstance(item, tuple):
                    item, interval = item
                placed.append(replace(item, offset=len(token_ids)))
                where.append((len(token_ids), _span_grid(item, self.merge), interval))
                token_ids.extend([tok] * item.length)
            else:
                token_ids.append(tok)
        positions, delta = mrope_positions(token_ids, where, self.merge)
        return PromptInputs(token_ids, placed, positions, delta, data)

    def _video_spans(self, item: ImageItem) -> list:
        """A video's placeholder spans in prompt order: one item (with Qwen2.5-VL's time interval) for the whole
        video, or (Qwen3-VL) one per temporal patch, each taking its rows of the video's embedding."""
        if not self.timestamps:
            if self.tokens_per_second is None:
                return [(item, 1)]
            tp = self.video_config.temporal_patch_size
            # NOTE: float32 as transformers computes it (second_per_grid_ts is a float32 tensor).
            second = torch.tensor(tp / item.video.plan.sampled_fps, dtype=torch.float32)
            return [(item, self.tokens_per_second * second)]
        t, h, w = item.grid
        per = h * w // self.merge**2
        return [replace(item, length=per, rows_from=k * per) for k in range(t)]

    def _timestamped(self, text: str, videos: list[ImageItem]) -> str:
        """Qwen3-VL's prompt: each video's wrapper becomes ``<t seconds>`` + a wrapper per temporal patch, as
        transformers' Qwen3VLProcessor writes it."""
        wrapper = "<|vision_start|><|video_pad|><|vision_end|>"
        pieces = text.split(wrapper)
        if len(pieces) != len(videos) + 1:
            raise InputError("the number of video placeholders does not match the number of videos")
        out = [pieces[0]]
        for video, rest in zip(videos, pieces[1:]):
            out += [f"<{t:.1f} seconds>{wrapper}" for t in video.video.plan.timestamps]
            out.append(rest)
        return "".join(out)

    def process_video(
        self, video: VideoInput, index: int = 0, cache_salt: str = "", budget: VideoBudget | None = None
    ) -> tuple[ImageItem, bytes]:
        """A video's item (placed at -1, its whole grid) and its bytes: probed (no decode), frames and grid
        planned at the ``budget`` of the video ladder (None: level 0). The request's fps and max_pixels (else
        the server's) are scaled by the level; its max_frames bounds the count. Its identity covers the bytes
        and the frames picked; the grid and settings are in the key."""
        cfg = self.video_config
        budget = budget or VideoBudget(0, 1.0, 1.0)
        fps = (video.fps or cfg.fps) * budget.fps_scale
        max_pixels = min(video.max_pixels or cfg.max_pixels, cfg.max_pixels)
        data = _offline_bytes(video.source)
        try:
            info = probe_video(data, cfg, list_fps=video.fps)
            plan = plan_video(info, cfg, fps, video.max_frames, max_pixels, budget.pixels_scale)
        except PreprocessError as exc:
            raise InputError(f"video {index}: {exc.message}", param="video_url", code=exc.code) from None
        return self.video_item(data, plan, cache_salt, max_pixels, budget.level), data

    def video_item(
        self,
        data: bytes,
        plan: VideoPlan,
        cache_salt: str = "",
        max_pixels: int | None = None,
        level: int = 0,
    ) -> ImageItem:
        digest = image_hash(data, self.hash_algorithm)
        identity = image_hash(
            b"vlmserve-video\0" + plan.identity() + b"\0" + digest.encode(), self.hash_algorithm
        )
        key = EmbeddingKey(
            identity,
            plan.grid,
            self.video_fingerprint,
            self.model_fingerprint,
            getattr(self.cfg, "deepstack_levels", 0),
            self.hash_algorithm,
            cache_salt,
        )
        job = VideoJob(self.video_config, plan, level)
        return ImageItem(-1, num_visual_tokens(plan.grid, self.merge), key, max_pixels, video=job)

    def process_image(
        self, data: bytes | Image.Image, max_pixels: int | None = None, index: int = 0, cache_salt: str = ""
    ) -> tuple[ImageItem, bytes]:
        """An image's item (placed at offset -1 until the prompt places it) and its encoded bytes.

        NOTE: a salted request's embedding key carries its salt, so the embedding cache (L1 and Redis) is not
        shared across salts either. An embedding hit is visible to the tenant as a much faster first token (an
        encoder pass takes seconds on a CPU), which would tell it that someone else sent this image recently:
        the very signal cache_salt exists to hide. Unsalted requests share as before."""
        if isinstance(data, Image.Image):
            data = encode_pil(data)
        try:
            info = probe(data, self.preprocess_config)
            grid = plan_grid(info, self.preprocess_config, max_pixels)
        except PreprocessError as exc:
            raise InputError(f"image {index}: {exc.message}", param="image_url", code=exc.code) from None
        key = EmbeddingKey(
            image_hash(data, self.hash_algorithm),
            grid,
            self.preprocess_fingerprint,
            self.model_fingerprint,
            getattr(self.cfg, "deepstack_levels", 0),
            self.hash_algorithm,
            cache_salt,
        )
        return ImageItem(-1, num_visual_tokens(grid, self.merge), key, max_pixels), data

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
