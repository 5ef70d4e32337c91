"""Test helpers shared across folders: prerequisites that CI must have, test images, chat builders, servers'
ports and metrics, and transformers as the oracle."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent


def run_fresh(code: str, *args: str, timeout: float = 240):
    """Run ``code`` in a fresh interpreter (nothing imported or preloaded by this one) from the repository
    root; returns the JSON object it printed last."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def on_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """A prerequisite is missing (a server, a compiler, a package): skip here, fail under ``CI=true``.

    CI provides every prerequisite (bin/setup, .ci/run), so a skip there would be a check that never ran.
    """
    if on_ci():
        pytest.fail(f"{reason} (CI is set, so this test must run)", pytrace=False)
    pytest.skip(reason)


def prerequisite(problem: str | None):
    """An autouse fixture for a test module (assign it to a module-level name): every test of the module
    goes through skip_or_fail while ``problem`` is not None. Each test fails on its own under CI, rather than
    a collection error stopping the whole run."""

    @pytest.fixture(autouse=True)
    def _prerequisite() -> None:
        if problem is not None:
            skip_or_fail(problem)

    return _prerequisite


def redis_client(url: str, timeout_s: float = 1.0):
    """A client of the test Redis at ``url`` (loopback, a test-only DB), once it answers; else skip_or_fail."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        client.close()
        skip_or_fail(f"Redis at {url} did not answer ({exc!r}); start redis-server on 127.0.0.1:6379")
    return client


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class QuietHandler(BaseHTTPRequestHandler):
    """A test server's request handler: keep-alive HTTP/1.1, no access log, whole bodies with a length."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def send_body(
        self, status: int, body: bytes, ctype: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{'name{label=value,...}': value}``, labels sorted."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def is_idle(m: dict[str, float]) -> bool:
    """No request runs or waits and every KV block is free (``m``: parse_metrics of a server's /metrics)."""
    return (
        m["vlmserve_num_requests_running"] == 0
        and m["vlmserve_num_requests_waiting"] == 0
        and m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
    )


def wait_idle(read_metrics: Callable[[], dict[str, float]], timeout_s: float, poll_s: float = 0.02):
    """A server's metrics once it is idle (``is_idle``), or the last look on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics()
        if is_idle(m) or time.monotonic() > deadline:
            return m
        time.sleep(poll_s)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def make_image(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A structured random picture (gradient + blocks + noise) encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * (seed % 7 + 1)) % 256, (yy * (seed % 5 + 2)) % 256, ((xx + yy) * 3) % 256], -1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    arr = ((base + noise) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image", "image": data}


def user(*parts) -> list[dict]:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def mixed_requests() -> list[list[dict]]:
    """Text-only, one image, two images; 56×56 up to 1024×768; short and long prompts."""
    long_text = "Please read the following notes carefully and answer briefly. " * 6
    return [
        user("Hi"),
        user("Tell me a story about a lighthouse keeper and the sea, in three short sentences."),
        user(long_text + "What is the main topic?"),
        user(image_part(make_image(56, 56, 1)), "What is this?"),
        user(image_part(make_image(224, 224, 2)), "Describe the picture."),
        user("Look at this: ", image_part(make_image(300, 200, 3)), " and say what you see."),
        user(image_part(make_image(333, 517, 4, "JPEG")), long_text),
        user(image_part(make_image(640, 480, 5, "JPEG")), "Count the shapes."),
        user(image_part(make_image(1024, 768, 6, "JPEG")), "What colour dominates?"),
        user(image_part(make_image(100, 150, 7)), image_part(make_image(150, 100, 8)), "Compare them."),
        user(
            image_part(make_image(448, 336, 9)),
            "First image.",
            image_part(make_image(56, 224, 10)),
            "Second.",
        ),
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {
                "role": "user",
                "content": [image_part(make_image(280, 280, 11)), {"type": "text", "text": "And here?"}],
            },
        ],
    ]


# The conversation whose greedy answer picks the EOS token of the `eos_ckpt` fixture (see tests/conftest.py).
EOS_PROBE = user("Tell me a story about a lighthouse keeper and the sea, in three short sentences.")


class HFOracle:
    """transformers' own processor + generate() on the same checkpoint (greedy; float32 unless asked)."""

    def __init__(self, ckpt: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(ckpt))
        self.model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=dtype).eval().to(device)
        self._memo: dict[tuple, list[int]] = {}

    def inputs(self, conv: list[dict]):
        images, videos, metadata, msgs = [], [], [], []
        for m in conv:
            content = m["content"]
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") == "image":
                        # NOTE: as transformers' own load_image does: EXIF orientation applied (its processor alone
                        # does not rotate PIL images), alpha left to the processor's convert_to_rgb.
                        images.append(ImageOps.exif_transpose(Image.open(io.BytesIO(p["image"]))))
                        parts.append({"type": "image"})
                    elif p.get("type") == "video":
                        frames, md = self._video(p)
                        videos.append(frames)
                        metadata.append(md)
                        parts.append({"type": "video"})
                    else:
                        parts.append(p)
                content = parts
            msgs.append({"role": m["role"], "content": content})
        text = self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        extra = {}
        if videos:
            extra = dict(
                videos=videos, video_metadata=metadata, do_sample_frames=False, cap_pixels_per_frame=False
            )
        return self.processor(text=[text], images=images or None, return_tensors="pt", **extra)

    def _video(self, part: dict):
        """A ``{"type": "video", "video": bytes | [frame bytes], "fps": ...}`` part as transformers takes it: every
        frame decoded by PyAV (or PIL), then the frames its own video processor's ``sample_frames`` picks."""
        import av
        from transformers.video_utils import VideoMetadata

        src, fps = part["video"], part.get("fps")
        vp = self.processor.video_processor
        if isinstance(src, list):
            frames = np.stack([np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in src])
            picked = list(range(len(frames)))
            rate = float(fps or 2.0)
        else:
            with av.open(io.BytesIO(src)) as c:
                rate = float(c.streams.video[0].average_rate)
                frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
            md = VideoMetadata(total_num_frames=len(frames), fps=rate)
            picked = [int(i) for i in vp.sample_frames(md, fps=fps or 2.0)]
        md = VideoMetadata(
            total_num_frames=len(frames),
            fps=rate,
            width=frames.shape[2],
            height=frames.shape[1],
            frames_indices=picked,
        )
        return frames[picked], md

    @torch.no_grad()
    def generate(self, conv: list[dict], max_new_tokens: int, **generate_kw) -> list[int]:
        """Greedy new token ids; ``generate_kw`` overrides the checkpoint's generation config (e.g. its EOS)."""
        key = (repr(conv), max_new_tokens, repr(sorted(generate_kw.items())))
        if key not in self._memo:
            inputs = self.inputs(conv).to(self.model.device)
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kw)
            self._memo[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
        return self._memo[key]


class RedisProxy:
    """A loopback TCP forwarder to the test Redis that a test can switch, so the machine's real Redis server is
    never stopped. ``mode``: "forward"; "blackhole" drops every byte clients send (a partitioned network: no
    answer ever comes); "stall" holds them until ``resume()`` (a Redis that hangs, then recovers; ``held`` is
    set once bytes were held). ``close()`` cuts every connection and the port then refuses (Redis gone).
    ``request_bytes`` counts what clients sent, forwarded or not."""

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 6379)) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held = threading.Event()
        self.request_bytes = 0
        self._mode = "forward"
        self._go = threading.Event()
        self._go.set()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in ("forward", "blackhole", "stall"):
            raise ValueError(f"proxy mode must be forward, blackhole or stall, got {mode!r}")
        self._mode = mode
        if mode == "stall":
            self.held.clear()
            self._go.clear()
        else:
            self._go.set()

    def stall(self) -> None:
        self.mode = "stall"

    def resume(self) -> None:
        self.mode = "forward"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        self.listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._go.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client:
                    self.request_bytes += len(data)
                    if self._mode == "blackhole":
                        continue
                    if not self._go.is_set():
                        self.held.set()
                        self._go.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


def make_clip(
    frames: int = 8,
    width: int = 64,
    height: int = 48,
    fps: int = 4,
    codec: str = "mpeg4",
    fmt: str = "mp4",
    gop: int = 4,
    seed: int = 0,
) -> bytes:
    """A video of a coloured square moving across a gradient (PyAV), ``gop`` frames per keyframe."""
    import av

    rng = np.random.default_rng(seed)
    colour = rng.integers(64, 256, 3)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.gop_size = gop
        yy, xx = np.mgrid[0:height, 0:width]
        side = max(4, min(width, height) // 3)
        for i in range(frames):
            img = np.stack([(xx * 3 + i * 5) % 256, (yy * 4) % 256, np.full_like(xx, 40 + 10 * seed)], -1)
            x0 = (i * 5) % max(1, width - side)
            y0 = (i * 3) % max(1, height - side)
            img[y0 : y0 + side, x0 : x0 + side] = colour
            frame = av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def video_part(data: bytes, mime: str = "video/mp4", **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime), **extra}}
