"""Errors a bad image raises, each with a stable code the API layer can map to a status."""

from __future__ import annotations

# Codes are part of the contract with api/: a client error for all of these except WORKER.
EMPTY = "empty"
TOO_MANY_BYTES = "too_many_bytes"
UNSUPPORTED_FORMAT = "unsupported_format"
CORRUPT = "corrupt"
ZERO_SIZE = "zero_size"
DECOMPRESSION_BOMB = "decompression_bomb"
ASPECT_RATIO = "aspect_ratio"
# Videos (preprocess/video.py) add:
NO_VIDEO_STREAM = "no_video_stream"  # audio-only, or no stream at all
UNSUPPORTED_CODEC = "unsupported_codec"
TOO_LONG = "too_long"
TOO_MANY_FRAMES = "too_many_frames"
TOO_MANY_PIXELS = "too_many_pixels"


class PreprocessError(ValueError):
    """The image cannot be preprocessed; `code` says why, `message` says it for a human."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]"


class PreprocessWorkerError(RuntimeError):
    """A pool worker died or hung while handling the request; the pool has replaced it."""
