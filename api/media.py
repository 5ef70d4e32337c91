"""Image URLs → bytes: data: URLs, http(s) behind the SSRF guard (api/ssrf.py) with byte, time and
redirect caps, and file:// under an allowed directory."""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from api.errors import APIError
from api.ssrf import AddressGuard, GuardedTransport, refused
from lm_engine.processor import _FRAME_LIST_TYPES, InputError, decode_data_url, decode_frame_list

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_VIDEO_BYTES = 64 * 1024 * 1024
DEFAULT_READ_TIMEOUT = 10.0


@dataclass(slots=True)
class MediaConfig:
    max_bytes: int = DEFAULT_MAX_BYTES  # per image, as received
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES  # per video (a frame list: all its frames), as received
    connect_timeout: float = 5.0
    read_timeout: float = DEFAULT_READ_TIMEOUT
    total_timeout: float = 30.0  # a whole fetch, redirects included (a slow drip resets the read timeout)
    max_redirects: int = 5
    allowed_domains: frozenset[str] = field(default_factory=frozenset)  # may resolve to private addresses
    allow_private: bool = False
    allowed_local_path: Path | None = None

    def __post_init__(self) -> None:
        if self.allowed_local_path is not None:
            root = Path(self.allowed_local_path).resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_path} is not a directory")
            self.allowed_local_path = root


class MediaFetcher:
    def __init__(self, config: MediaConfig) -> None:
        self.config = config
        self.guard = AddressGuard(config.allowed_domains, config.allow_private)
        self.client = httpx.AsyncClient(
            transport=GuardedTransport(self.guard),
            trust_env=False,  # an environment proxy would connect where the guard cannot see
            follow_redirects=False,  # followed by hand, so every hop is checked
            timeout=httpx.Timeout(config.read_timeout, connect=config.connect_timeout),
            headers={"User-Agent": "vlmserve", "Accept-Encoding": "identity"},
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str) -> bytes:
        """The bytes behind an image URL; raises APIError (4xx) for anything a client got wrong."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data(url)
        if scheme in ("http", "https"):
            return await self._http(url)
        if scheme == "file":
            return await asyncio.to_thread(self._file, url)
        raise APIError(
            400,
            f"unsupported image URL scheme {scheme!r}: use data:, http(s): or file:",
            param="image_url",
            code="invalid_image_url",
        )

    async def fetch_video(self, url: str) -> bytes:
        """The bytes behind a video URL (the same guard and caps as images, ``max_video_bytes`` for size); a
        frame list (``data:video/jpeg;base64,<frame>,<frame>,...``) comes back packed (preprocess.video)."""
        if url.startswith(_FRAME_LIST_TYPES):
            if (len(url) - url.find(",") - 1) * 3 // 4 > self.config.max_video_bytes + 3:
                raise self._too_large("the data: URL video", self.config.max_video_bytes)
            try:
                return decode_frame_list(url)
            except InputError as exc:
                raise APIError(400, str(exc), param="video_url", code="invalid_video_url") from None
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        cap = self.config.max_video_bytes
        if scheme == "data":
            return self._data(url, cap)
        if scheme in ("http", "https"):
            return await self._http(url, cap)
        if scheme == "file":
            return await asyncio.to_thread(self._file, url, cap)
        raise APIError(
            400,
            f"unsupported video URL scheme {scheme!r}: use data:, http(s): or file:",
            param="video_url",
            code="invalid_video_url",
        )

    def _too_large(self, what: str, cap: int | None = None) -> APIError:
        return APIError(
            413,
            f"{what} is larger than the {cap or self.config.max_bytes}-byte limit",
            param="image_url",
            code="media_too_large",
        )

    def _data(self, url: str, cap: int | None = None) -> bytes:
        cap = cap or self.config.max_bytes
        payload_len = len(url) - url.find(",") - 1
        if payload_len * 3 // 4 > cap + 3:
            raise self._too_large("the data: URL media", cap)
        try:
            data = decode_data_url(url)
        except InputError as exc:
            raise APIError(400, str(exc), param="image_url", code="invalid_image_url") from None
        if len(data) > cap:
            raise self._too_large("the data: URL media", cap)
        return data

    async def _http(self, url: str, cap: int | None = None) -> bytes:
        cfg = self.config
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise APIError(
                400, f"invalid image URL: {exc}", param="image_url", code="invalid_image_url"
            ) from None
        try:
            async with asyncio.timeout(cfg.total_timeout):
                for _ in range(cfg.max_redirects + 1):
                    if target.scheme not in ("http", "https") or not target.host:
                        raise refused(f"image redirect to {target.scheme}: URLs is not followed")
                    async with self.client.stream("GET", target) as resp:
                        if not resp.has_redirect_location:
                            return await self._body(resp, target, cap or cfg.max_bytes)
                        target = resp.url.join(resp.headers["location"])
                raise _fetch_failed(f"image URL redirected more than {cfg.max_redirects} times")
        except (TimeoutError, httpx.TimeoutException):
            raise _fetch_failed(
                f"fetching the image from {target.host} timed out", "media_fetch_timeout"
            ) from None
        except httpx.HTTPError as exc:
            raise _fetch_failed(
                f"fetching the image from {target.host} failed: {type(exc).__name__}: {exc}"
            ) from None

    async def _body(self, resp: httpx.Response, target: httpx.URL, cap: int) -> bytes:
        """A 200 response's body, read no further than the byte cap."""
        if resp.status_code != 200:
            raise _fetch_failed(f"fetching the image from {target.host} failed: HTTP {resp.status_code}")
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise self._too_large(f"the media at {target.host}", cap)
        buf = bytearray()
        async for chunk in resp.aiter_bytes():
            buf += chunk
            if len(buf) > cap:
                raise self._too_large(f"the media at {target.host}", cap)
        return bytes(buf)

    def _file(self, url: str, cap: int | None = None) -> bytes:
        cap = cap or self.config.max_bytes
        root = self.config.allowed_local_path
        if root is None:
            raise refused("file: image URLs are disabled (start the server with --allowed-local-media-path)")
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise refused("file: image URLs must name a local path")
        try:
            path = Path(unquote(parts.path)).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            raise APIError(
                400, "image file not found", param="image_url", code="media_fetch_failed"
            ) from None
        if not path.is_relative_to(root):
            raise refused("image file is outside --allowed-local-media-path")
        try:
            # O_NONBLOCK: opening a FIFO must not hang the worker; the fstat below refuses it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            raise APIError(
                400, "image file cannot be opened", param="image_url", code="media_fetch_failed"
            ) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            proc = f"/proc/self/fd/{fd}"
            # The file opened must still be inside the root (a directory swapped for a symlink after resolve()).
            if os.path.exists(proc) and not Path(os.readlink(proc)).is_relative_to(root):
                raise refused("image file is outside --allowed-local-media-path")
            if not stat.S_ISREG(st.st_mode):
                raise refused("image path is not a regular file")
            if st.st_size > cap:
                raise self._too_large("the media file", cap)
            data = f.read(cap + 1)
        if len(data) > cap:
            raise self._too_large("the media file", cap)
        return data


def _fetch_failed(message: str, code: str = "media_fetch_failed") -> APIError:
    return APIError(400, message, param="image_url", code=code)
