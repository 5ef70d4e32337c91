"""Server settings (the engine's own live in lm_engine.config)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from api.media import MediaConfig
from lm_engine.config import EngineConfig

MODALITIES = ("image", "video", "audio")
DEFAULT_IMAGE_LIMIT = 16


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


@dataclass(slots=True)
class ServerArgs:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(
        default_factory=list
    )  # the first is reported; default: the model path
    api_key: str | None = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    media: MediaConfig = field(default_factory=MediaConfig)
    max_request_bytes: int = 64 * 1024 * 1024  # the whole JSON body, data: URLs included
    preprocess_threads: int = 2  # chat templating, tokenization and image processing off the event loop
    log_level: str = "info"
    replica_name: str | None = None  # sent as x-vlmserve-replica on every response (api/replica.py)

    @property
    def max_images(self) -> int:
        return self.limit_mm_per_prompt.get("image", DEFAULT_IMAGE_LIMIT)

    @property
    def model_names(self) -> list[str]:
        """Names clients may use in ``model``; the first is the one reported."""
        return self.served_model_names or [self.engine.model]
