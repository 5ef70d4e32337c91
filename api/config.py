"""Server settings (the engine's own live in lm_engine.config)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from api.media import MediaConfig
from lm_engine.config import EngineConfig

MODALITIES = ("image", "video", "audio")
DEFAULT_IMAGE_LIMIT = 16
DEFAULT_VIDEO_LIMIT = 1  # a video is hundreds to thousands of visual tokens


def parse_limit_mm(text: str) -> dict[str, int]:
    """vLLM's ``--limit-mm-per-prompt``: ``image=4`` / ``image=4,video=0`` or JSON ``{"image": 4}``."""
    text = text.strip()
    if text.startswith("{"):
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("--limit-mm-per-prompt JSON must be an object")
        items = list(raw.items())
    else:
        items = []
        for pair in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"--limit-mm-per-prompt: expected modality=count, got {pair!r}")
            items.append((key.strip(), value.strip()))
    out = {}
    for key, value in items:
        if key not in MODALITIES:
            raise ValueError(
                f"--limit-mm-per-prompt: unknown modality {key!r} (known: {', '.join(MODALITIES)})"
            )
        count = -1 if isinstance(value, bool) else int(value)
        if count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {key} must be a count >= 0")
        out[key] = count
    return out


@dataclass(slots=True, frozen=True)
class ConnectionLimits:
    """What a client may take of the server before its request is read (api/http_guard.py)."""

    header_timeout_s: float = 15.0  # a request's head, from its first byte (or from the connection)
    body_timeout_s: float = 120.0  # its body, from the end of the head
    max_connections: int = 1024  # open at once; past it a new one gets a 503 and is closed


@dataclass(slots=True)
class ServerArgs:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(
        default_factory=list
    )  # the first is reported; default: the model path
    api_key: str | None = None  # one more key (named "default"), for callers that set a single one
    api_keys: dict[str, str] = field(default_factory=dict)  # key → its tenant's name
    # Each key's tenant gets its own prefix and embedding caches (a salt in every cache key), so one tenant
    # cannot tell from cached_tokens or a fast first token what another sent. Off: keys share the caches.
    cache_salt_per_api_key: bool = True
    metrics_public: bool = False  # /metrics without a key even when keys are set
    # Peers whose X-Forwarded-For names the client (a balancer in front); anyone else's is ignored.
    trusted_proxies: list[str] = field(default_factory=list)
    # The request's `user` field as the fairness identity (behind a gateway that sets it); otherwise a
    # client could take many fair shares by naming itself anew, or get a victim refused by naming it.
    fair_share_by_user: bool = False
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    parse_off_loop_bytes: int = 256 * 1024  # larger bodies are parsed on a worker thread
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    media: MediaConfig = field(default_factory=MediaConfig)
    max_request_bytes: int = 64 * 1024 * 1024  # the whole JSON body, data: URLs included
    preprocess_threads: int = 2  # chat templating, tokenization and image processing off the event loop
    log_level: str = "info"
    # "qwen3": a <think>…</think> block in the output is message.reasoning_content (as vLLM's parser of that
    # name); None: the output is all content.
    reasoning_parser: str | None = None
    replica_name: str | None = None  # sent as x-vlmserve-replica on every response (api/replica.py)

    def __post_init__(self) -> None:
        if self.api_key:
            self.api_keys = {**self.api_keys, self.api_key: self.api_keys.get(self.api_key, "default")}

    @property
    def max_images(self) -> int:
        return self.limit_mm_per_prompt.get("image", DEFAULT_IMAGE_LIMIT)

    @property
    def max_videos(self) -> int:
        return self.limit_mm_per_prompt.get("video", DEFAULT_VIDEO_LIMIT)

    @property
    def model_names(self) -> list[str]:
        """Names clients may use in ``model``; the first is the one reported."""
        return self.served_model_names or [self.engine.model]


def tenant_name(key: str) -> str:
    """A key's tenant when none is named: a digest prefix, so logs and metrics never hold the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def read_api_keys(path: str | Path) -> dict[str, str]:
    """``--api-key-file``: one key per line, optionally followed by the tenant's name (``KEY [NAME]``); blank lines
    and ``#`` comments are skipped. Keys sharing a name are one tenant."""
    keys: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, name = line.partition(" ")
        if key in keys:
            raise ValueError(f"{path}:{n}: a key is listed twice")
        keys[key] = name.strip() or tenant_name(key)
    if not keys:
        raise ValueError(f"{path}: no API keys in it")
    return keys
