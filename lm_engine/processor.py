"""Chat messages → prompt token ids, image items and M-RoPE positions (the model family's rules)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
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
from preprocess import PreprocessConfig, PreprocessError, image_hash, num_visual_tokens, plan_grid, probe
from preprocess.hashing import DEFAULT_HASH, check_algorithm

_VIDEO_PARTS = ("video", "video_url", "input_video")


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
class ChatInput:
    """Chat messages normalized: for the template, image parts reduced to ``{"type": "image"}``; the image
    parts themselves in prompt order."""

    messages: list[dict]
    images: list[ImageInput]
    tools: list[dict] | None = None  # OpenAI tool objects the prompt offers the model (None: none)


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


def normalize_messages(messages: list[dict]) -> ChatInput:
    """OpenAI-style messages (text, ``image_url`` and ``image`` parts) → the one form every entry point uses
    (the server, ``vlmserve batch`` and the offline ``LLM``)."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list", param="messages")
    out, images = [], []
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
                raise InputError(
                    f"messages[{i}]: video input is not supported (image and text parts only)",
                    param="messages",
                    code="unsupported_modality",
                )
            else:
                raise InputError(f"messages[{i}]: unsupported content part type {kind!r}", param="messages")
        out.append({"role": msg["role"], "content": parts, **calls})
    return ChatInput(out, images)


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
        ids = self.tokenizer.encode(self.render(chat.messages, chat.tools), add_special_tokens=False).ids
        pad = self.cfg.image_token_id
        if ids.count(pad) != len(chat.images):
            raise InputError("the number of image placeholders does not match the number of images")
        items, data = [], {}
        for i, image in enumerate(chat.images):
            item, data_i = self.process_image(
                _offline_bytes(image.source), budget(image.detail) if budget else None, i, cache_salt
            )
            items.append(item)
            data[item.key] = data_i
        token_ids: list[int] = []
        placed = []
        pending = iter(items)
        for tok in ids:
            if tok == pad:
                item = next(pending)
                placed.append(replace(item, offset=len(token_ids)))
                token_ids.extend([pad] * item.length)
            else:
                token_ids.append(tok)
        positions, delta = mrope_positions(token_ids, [(i.offset, i.grid) for i in placed], self.merge)
        return PromptInputs(token_ids, placed, positions, delta, data)

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
