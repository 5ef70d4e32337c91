"""Load generator for any OpenAI-compatible chat endpoint serving a VLM (ours, vLLM, ``transformers serve``).

The request trace (arrival times, images, prompts, ``max_tokens``) is drawn from ``--seed`` before the run
and can be saved and replayed (``--save-trace``/``--trace``), so two servers are driven with the same
requests. Images are synthetic but photo-like (gradients, shapes, sensor noise: JPEG ~1.2 bits/pixel,
PNG ~13.5), generated once before the run and sent inline as base64 ``data:`` URLs. Each request streams
(SSE, ``stream_options.include_usage``); every content chunk is timestamped as it arrives.

Reported: TTFT, TPOT = (e2e - TTFT) / (output_tokens - 1), inter-token latency (between content chunks)
and end-to-end latency (p50/p90/p99), request and output-token throughput, goodput under
``--slo-ttft-ms``/``--slo-tpot-ms``, errors by kind and status (503 refusals with their latency), and the
distribution of ``x-vlmserve-*``/``x-visual-budget-*`` response headers and of the visual budget levels
vlmserve reports in ``usage``. Every request is bounded by
``--request-timeout-s``; a server that errors, stalls or breaks its stream is reported, never waited on.

    .venv/bin/python benchmarks/load.py --concurrency 16 -n 64 --max-tokens 128 --ignore-eos
    .venv/bin/python benchmarks/load.py --rates 0.25,0.5,1 -n 32 --slo-ttft-ms 3000 --slo-tpot-ms 150 \\
        --out benchmarks/out/load.json --plot-dir benchmarks/out/load
    .venv/bin/python benchmarks/load.py -n 64 --seed 1 --save-trace t.json --generate-only
    .venv/bin/python benchmarks/load.py --trace t.json --base-url http://127.0.0.1:8001/v1 --concurrency 16
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import base64
import contextlib
import hashlib
import io
import ipaddress
import json
import math
import os
import platform
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

TRACE_FORMAT = "vlmserve-load-trace/1"
# NOTE: bump when synth_image's pixels change, so disk-cached images and saved digests stop matching.
IMAGE_GENERATOR = "synth/1"
DEFAULT_RESOLUTIONS = "224x224,448x336,896x672,1344x1008,2048x1536"
# Response headers worth tallying: ours (the visual budget level each image got) and any x-vlmserve-*.
HEADER_PREFIXES = ("x-vlmserve-", "x-visual-budget-")
ERROR_BODY_CAP = 64 * 1024

PROMPTS = [
    "Describe this image in detail.",
    "What objects can you see in the picture?",
    "What colors dominate this image?",
    "Summarize the content of the image in one sentence.",
    "Is there any text in the image? If so, transcribe it.",
    "Count the distinct shapes in the image.",
    "Where is the brightest region of the image?",
    "Write a short caption for this picture.",
    "What is in the top-left corner?",
    "Compare the left and right halves of the image.",
    "List three things a viewer would notice first.",
    "What might this image be used for?",
]
FILLER = (
    "the report notes that the quarterly figures were revised after the audit while the team reviewed "
    "shipping delays across three regions and proposed a new schedule for the spring release of the "
    "product line including updated pricing and a summary of customer feedback from recent surveys"
).split()


# ---------------------------------------------------------------- small parsers


def parse_weighted(text: str) -> dict[str, float]:
    """``"a:2,b,c:0.5"`` → ``{"a": 2.0, "b": 1.0, "c": 0.5}`` (an item without a weight weighs 1)."""
    out: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, weight = item.partition(":")
        w = float(weight) if weight else 1.0
        if w < 0 or not math.isfinite(w):
            raise ValueError(f"bad weight in {item!r}")
        out[name.strip().lower()] = out.get(name.strip().lower(), 0.0) + w
    if not out or sum(out.values()) <= 0:
        raise ValueError(f"no positive weights in {text!r}")
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``"32,256"`` → (32, 256); ``"128"`` → (128, 128)."""
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if a > b or a < 0:
        raise ValueError(f"bad range {text!r}")
    return a, b


def parse_resolution(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    width, height = int(w), int(h or w)
    if width < 1 or height < 1:
        raise ValueError(f"bad resolution {text!r}")
    return width, height


def _pick(rng: random.Random, weighted: dict[str, float]) -> str:
    names = sorted(weighted)
    return rng.choices(names, weights=[weighted[n] for n in names])[0]


# ---------------------------------------------------------------- the trace


@dataclass(slots=True)
class TraceSpec:
    """How a trace is drawn; every field is plain JSON so the spec travels inside the trace file."""

    num_requests: int = 64
    seed: int = 0
    resolutions: dict[str, float] = field(default_factory=lambda: parse_weighted(DEFAULT_RESOLUTIONS))
    formats: dict[str, float] = field(default_factory=lambda: {"jpeg": 1.0, "png": 1.0})
    images_per_request: dict[str, float] = field(default_factory=lambda: {"1": 1.0})
    # NOTE: per image slot: the chance it reuses an image an earlier request sent (an embedding-cache hit).
    repeat_share: float = 0.0
    detail: dict[str, float] = field(default_factory=lambda: {"none": 1.0})
    max_tokens: tuple[int, int] = (128, 128)
    prompt_words: tuple[int, int] = (0, 0)
    jpeg_quality: tuple[int, int] = (80, 95)


@dataclass(slots=True)
class ImageSpec:
    id: int
    width: int
    height: int
    format: str  # "jpeg" | "png"
    seed: int
    quality: int  # JPEG quality; unused for PNG


@dataclass(slots=True)
class TraceRequest:
    t_unit: float  # arrival time at 1 request/s; at rate R the request is sent at t_unit / R
    prompt: str
    max_tokens: int
    images: list[int]  # ImageSpec ids, in prompt order
    detail: str | None  # image_url.detail, or None to leave it out


@dataclass(slots=True)
class Trace:
    spec: dict
    images: list[ImageSpec]
    requests: list[TraceRequest]
    # id → sha256 of the encoded bytes, filled once the images exist; lets a replay check its pixels.
    image_sha256: dict[int, str] = field(default_factory=dict)

    def digest(self) -> str:
        """sha256 of the canonical trace (spec, image specs, requests): equal digests, equal requests."""
        body = {
            "spec": self.spec,
            "images": [asdict(i) for i in self.images],
            "requests": [asdict(r) for r in self.requests],
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def head(self, n: int) -> Trace:
        """The first ``n`` requests and only the images they use."""
        reqs = self.requests[:n]
        used = {i for r in reqs for i in r.images}
        return Trace(
            self.spec,
            [i for i in self.images if i.id in used],
            reqs,
            {k: v for k, v in self.image_sha256.items() if k in used},
        )


def make_trace(spec: TraceSpec) -> Trace:
    """Draw the whole trace from ``spec.seed``: same spec, same trace (and same digest)."""
    rng = random.Random(spec.seed)
    images: list[ImageSpec] = []
    requests: list[TraceRequest] = []
    t = 0.0
    for _ in range(spec.num_requests):
        ids: list[int] = []
        for _ in range(int(_pick(rng, spec.images_per_request))):
            if images and rng.random() < spec.repeat_share:
                ids.append(rng.choice(images).id)
                continue
            w, h = parse_resolution(_pick(rng, spec.resolutions))
            fmt = _pick(rng, spec.formats)
            images.append(
                ImageSpec(len(images), w, h, fmt, rng.getrandbits(32), rng.randint(*spec.jpeg_quality))
            )
            ids.append(images[-1].id)
        question = rng.choice(PROMPTS)
        words = rng.randint(*spec.prompt_words)
        prompt = (" ".join(rng.choices(FILLER, k=words)) + "\n\n" + question) if words else question
        detail = _pick(rng, spec.detail)
        requests.append(
            TraceRequest(t, prompt, rng.randint(*spec.max_tokens), ids, None if detail == "none" else detail)
        )
        t += rng.expovariate(1.0)  # Poisson arrivals: exponential gaps; the first request goes at 0
    spec_json = json.loads(json.dumps(asdict(spec)))  # tuples → lists, as they come back from a file
    return Trace(spec_json, images, requests)


def save_trace(trace: Trace, path: str | Path) -> None:
    body = {
        "format": TRACE_FORMAT,
        "image_generator": IMAGE_GENERATOR,
        "digest": trace.digest(),
        "spec": trace.spec,
        "images": [
            asdict(i) | ({"sha256": trace.image_sha256[i.id]} if i.id in trace.image_sha256 else {})
            for i in trace.images
        ],
        "requests": [asdict(r) for r in trace.requests],
    }
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def load_trace(path: str | Path) -> Trace:
    body = json.loads(Path(path).read_text())
    if body.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a {TRACE_FORMAT} file (format={body.get('format')!r})")
    images, sha = [], {}
    for raw in body["images"]:
        digest = raw.pop("sha256", None)
        images.append(ImageSpec(**raw))
        if digest and body.get("image_generator") == IMAGE_GENERATOR:
            sha[images[-1].id] = digest
    return Trace(body["spec"], images, [TraceRequest(**r) for r in body["requests"]], sha)


# ---------------------------------------------------------------- images


def synth_image(width: int, height: int, fmt: str, seed: int, quality: int = 90) -> bytes:
    """A photo-like picture: smooth gradients and waves, flat shapes, sensor noise; encoded as ``fmt``."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    # NOTE: shapes are drawn at 1/4 scale and upsampled bicubically: soft edges like a photo, and fast.
    sw, sh = max(8, width // 4), max(8, height // 4)
    y = np.linspace(0, 1, sh, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, sw, dtype=np.float32)[None, :]
    chans = []
    for _ in range(3):
        a, b = rng.uniform(-90, 90, 2)
        fx, fy = rng.uniform(0.5, 4, 2)
        phase = rng.uniform(0, 2 * np.pi)
        chans.append(128 + a * (x - 0.5) + b * (y - 0.5) + 40 * np.sin(2 * np.pi * (fx * x + fy * y) + phase))
    img = Image.fromarray(np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(8, 24))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, sw, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, sh, 2))
        color = tuple(int(v) for v in rng.integers(0, 256, 3))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            draw.rectangle([x0, y0, x1, y1], fill=color)
        elif kind == 1:
            draw.ellipse([x0, y0, x1, y1], fill=color)
        else:
            draw.line([x0, y0, x1, y1], fill=color, width=int(rng.integers(1, max(2, sw // 60))))
    arr = np.asarray(img.resize((width, height), Image.Resampling.BICUBIC)).astype(np.int16)
    arr += rng.integers(-6, 7, size=arr.shape, dtype=np.int16)
    out = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    if fmt == "jpeg":
        out.save(buf, "JPEG", quality=quality)
    elif fmt == "png":
        out.save(buf, "PNG")
    else:
        raise ValueError(f"unknown image format {fmt!r} (jpeg or png)")
    return buf.getvalue()


class ImageStore:
    """The trace's images as ``data:`` URLs, all encoded before the run so none is made on the request path."""

    def __init__(self, trace: Trace, cache_dir: str | Path | None = None) -> None:
        self.trace = trace
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.urls: dict[int, bytes] = {}  # ASCII data: URLs, JSON-safe as they are
        self.nbytes: dict[int, int] = {}
        self.mismatched: list[int] = []  # images whose bytes differ from the loaded trace's digests

    def _cache_path(self, s: ImageSpec) -> Path | None:
        if self.cache_dir is None:
            return None
        ext = "jpg" if s.format == "jpeg" else "png"
        q = f"-q{s.quality}" if s.format == "jpeg" else ""
        return self.cache_dir / f"{IMAGE_GENERATOR.replace('/', '')}-{s.width}x{s.height}-{s.seed}{q}.{ext}"

    def _make(self, s: ImageSpec) -> bytes:
        path = self._cache_path(s)
        if path is not None and path.exists():
            return path.read_bytes()
        data = synth_image(s.width, s.height, s.format, s.seed, s.quality)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return data

    def prepare(self, workers: int = 2) -> None:
        todo = [s for s in self.trace.images if s.id not in self.urls]
        # NOTE: Pillow's encoders and numpy release the GIL, so threads do use both cores.
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for s, data in zip(todo, pool.map(self._make, todo)):
                digest = hashlib.sha256(data).hexdigest()
                expected = self.trace.image_sha256.get(s.id)
                if expected is not None and expected != digest:
                    self.mismatched.append(s.id)
                self.trace.image_sha256[s.id] = digest
                self.nbytes[s.id] = len(data)
                mime = "jpeg" if s.format == "jpeg" else "png"
                self.urls[s.id] = f"data:image/{mime};base64,".encode() + base64.b64encode(data)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())


# ---------------------------------------------------------------- one request


def check_loopback(base_url: str, allow_remote: bool = False) -> None:
    """Refuse a non-loopback target unless allowed: this tool floods whatever it points at."""
    url = httpx.URL(base_url)
    if url.scheme not in ("http", "https"):
        raise ValueError(f"--base-url must be http(s)://…, got {base_url!r}")
    if allow_remote:
        return
    host = url.host
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing non-loopback target {host!r} (pass --allow-remote to load another host)")


@dataclass(slots=True)
class Target:
    base_url: str
    model: str
    api_key: str | None = None
    temperature: float | None = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    allow_remote: bool = False
    # "openai": OpenAI fields plus vLLM's ignore_eos (ours, vLLM, SGLang). "transformers": `transformers serve`
    # rejects stream_options and ignore_eos (422); it sends usage anyway, and min_new_tokens stands in.
    dialect: str = "openai"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_body(req: TraceRequest, images: ImageStore, target: Target) -> bytes:
    """The request's JSON. Image URLs (megabytes of base64, JSON-safe as they are) are spliced in as bytes:
    json.dumps over them took ~20 ms per large image on the event loop, delaying sends and timestamps."""
    detail = b"" if req.detail is None else b',"detail":' + json.dumps(req.detail).encode()
    pieces = [b'{"messages":[{"role":"user","content":[']
    for image_id in req.images:
        pieces += [b'{"type":"image_url","image_url":{"url":"', images.urls[image_id], b'"', detail, b"}},"]
    pieces.append(json.dumps({"type": "text", "text": req.prompt}).encode() + b"]}],")
    rest: dict = {"model": target.model, "max_tokens": req.max_tokens, "stream": True}
    if target.dialect != "transformers":
        rest["stream_options"] = {"include_usage": True}
    if target.temperature is not None:
        rest["temperature"] = target.temperature
    if target.ignore_eos and target.dialect == "transformers":
        rest["generation_config"] = json.dumps(
            {"max_new_tokens": req.max_tokens, "min_new_tokens": req.max_tokens}
        )
    elif target.ignore_eos:
        rest["ignore_eos"] = True  # vLLM extension
    rest.update(target.extra_body)
    pieces.append(json.dumps(rest, separators=(",", ":")).encode()[1:])
    return b"".join(pieces)  # one copy of the megabytes


@dataclass(slots=True)
class RequestRecord:
    """What one request did, times in seconds: ``start_s`` from the run's start, the rest from its send."""

    index: int
    scheduled_s: float | None = None  # planned send time (rate mode), from the run's start
    start_s: float | None = None
    request_bytes: int = 0
    status: int | None = None
    headers_s: float | None = None  # response headers received
    chunk_times_s: list[float] = field(default_factory=list)  # each chunk that carried content
    e2e_s: float | None = None
    done: bool = False  # saw `data: [DONE]`
    finish_reason: str | None = None
    text: str = ""  # the reply's content, for benchmarks that score answers
    usage: dict | None = None
    headers: dict[str, str] = field(default_factory=dict)  # HEADER_PREFIXES matches and retry-after
    error_kind: str | None = None  # http | timeout | incomplete | malformed | stream_error | connect | ...
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.status == 200

    @property
    def output_tokens(self) -> int:
        """From ``usage`` when the server sent it, else the number of content chunks."""
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return len(self.chunk_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:  # the first fault is the cause; later ones are its consequences
            self.error_kind, self.error = kind, message[:500]

    def to_json(self) -> dict:
        d = asdict(self)
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        d |= {
            "ok": self.ok,
            "output_tokens": self.output_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
        }
        return d


class _StreamFault(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _error_message(raw: bytes) -> str:
    """The OpenAI error body's message (or FastAPI's ``detail``), else the raw text."""
    text = raw.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, AttributeError):
        obj = json.loads(text)
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err:
            return str(err)
    return text.strip()[:300] or "(empty body)"


async def _read_capped(resp: httpx.Response, cap: int = ERROR_BODY_CAP) -> bytes:
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) >= cap:
            break
    return bytes(buf[:cap])


def _on_event(data: str, t: float, rec: RequestRecord) -> bool:
    """Apply one SSE event's data to ``rec``; True when the stream is over (``[DONE]``)."""
    if data.strip() == "[DONE]":
        rec.done = True
        return True
    try:
        obj = json.loads(data)
    except ValueError:
        raise _StreamFault("malformed", f"event is not JSON: {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise _StreamFault("malformed", f"event is not a JSON object: {data[:80]!r}")
    if obj.get("error"):
        raise _StreamFault("stream_error", _error_message(json.dumps(obj).encode()))
    content = False
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        content = content or bool(delta.get("content") or delta.get("reasoning_content"))
        rec.text += delta.get("content") or ""
        rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    if content:
        rec.chunk_times_s.append(t)
    if isinstance(obj.get("usage"), dict):
        rec.usage = obj["usage"]
    return False


async def _read_sse(resp: httpx.Response, rec: RequestRecord, t0: float) -> None:
    data: list[str] = []
    t_event = 0.0
    async for line in resp.aiter_lines():
        now = time.perf_counter() - t0
        if not line:  # a blank line ends the event
            if data and _on_event("\n".join(data), t_event, rec):
                return
            data = []
        elif line.startswith("data:"):
            if not data:
                t_event = now
            data.append(line[6:] if line.startswith("data: ") else line[5:])
        elif line.startswith(":") or line.split(":", 1)[0] in ("event", "id", "retry"):
            continue  # comments (keep-alive pings) and fields we don't use
        else:
            raise _StreamFault("malformed", f"not an SSE line: {line[:80]!r}")
    if data and _on_event("\n".join(data), t_event, rec):
        return
    # NOTE: `transformers serve` ends with a finish_reason chunk and no [DONE]; a clean end after a
    # finish_reason is a complete answer, a clean end before one is a truncated stream.
    if rec.finish_reason is None:
        raise _StreamFault(
            "incomplete",
            f"stream ended without finish_reason or [DONE] after {len(rec.chunk_times_s)} content chunks",
        )


def _stage(rec: RequestRecord) -> str:
    if rec.status is None:
        return "no response headers"
    if not rec.chunk_times_s:
        return f"HTTP {rec.status}, no token yet"
    return f"mid-stream after {len(rec.chunk_times_s)} content chunks"


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: bytes,
    rec: RequestRecord,
    timeout_s: float,
    run_start: float,
    header_prefixes: tuple[str, ...] = HEADER_PREFIXES,
) -> None:
    """POST one streaming chat request and fill ``rec``; never raises for server faults, never outlives
    ``timeout_s``."""
    rec.request_bytes = len(body)
    t0 = time.perf_counter()
    rec.start_s = t0 - run_start
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.stream("POST", url, content=body, headers=headers) as resp,
        ):
            rec.status = resp.status_code
            rec.headers_s = time.perf_counter() - t0
            rec.headers = {
                k: v for k, v in resp.headers.items() if k.startswith(header_prefixes) or k == "retry-after"
            }
            if resp.status_code != 200:
                rec.fail("http", _error_message(await _read_capped(resp)))
                return
            await _read_sse(resp, rec, t0)
    except _StreamFault as exc:
        rec.fail(exc.kind, str(exc))
    except (TimeoutError, httpx.TimeoutException):
        rec.fail("timeout", f"no complete answer within {timeout_s:g} s ({_stage(rec)})")
    except httpx.ConnectError as exc:
        rec.fail("connect", str(exc) or type(exc).__name__)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        kind = "incomplete" if rec.status == 200 else "connection"
        rec.fail(kind, f"{type(exc).__name__}: {exc} ({_stage(rec)})")
    except httpx.HTTPError as exc:
        rec.fail("transport", f"{type(exc).__name__}: {exc}")
    finally:
        rec.e2e_s = time.perf_counter() - t0


async def discover_model(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0, allow_remote: bool = False
) -> str:
    """The first model ``GET {base_url}/models`` lists."""
    check_loopback(base_url, allow_remote)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        resp = await client.get(base_url.rstrip("/") + "/models", headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return data[0]["id"]


# ---------------------------------------------------------------- the run


@dataclass(slots=True)
class LoadMode:
    rate: float | None = None  # requests/s, Poisson; None or inf: no pacing
    concurrency: int | None = None  # most requests in flight; None: unbounded
    duration_s: float | None = None  # no request starts after this; in-flight ones get their timeout
    request_timeout_s: float = 120.0

    def label(self) -> str:
        parts = []
        if self.rate is not None:
            parts.append(f"rate {self.rate:g}/s" if math.isfinite(self.rate) else "rate inf")
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        return ", ".join(parts) or "all at once"


@dataclass(slots=True)
class RunResult:
    mode: LoadMode
    records: list[RequestRecord]
    planned: int
    duration_s: float
    interrupted: bool = False


async def _race(aw: Awaitable, stop: asyncio.Event, deadline: float | None) -> bool:
    """Await ``aw`` unless ``stop`` fires or the ``perf_counter`` deadline passes; True if ``aw`` finished."""
    main = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
    try:
        done, _ = await asyncio.wait({main, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (main, stopper):
            t.cancel()
    return main in done


async def run_load(
    trace: Trace,
    images: ImageStore,
    target: Target,
    mode: LoadMode,
    *,
    stop: asyncio.Event | None = None,
    progress_every_s: float | None = None,
) -> RunResult:
    """Send the trace; return one record per request started. Bounded: a request lasts at most
    ``request_timeout_s``; with ``duration_s`` the whole run lasts at most ``duration_s + request_timeout_s``;
    setting ``stop`` (Ctrl-C) cancels what is in flight and returns what was measured."""
    check_loopback(target.base_url, target.allow_remote)
    if mode.concurrency is not None and mode.concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    stop = stop or asyncio.Event()
    rate = mode.rate if mode.rate is not None and math.isfinite(mode.rate) else None
    if rate is not None and rate <= 0:
        raise ValueError("rate must be positive")
    url = target.base_url.rstrip("/") + "/chat/completions"
    headers = target.headers()
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task] = set()
    active = 0
    slot_free = asyncio.Event()
    start = time.perf_counter()
    launch_deadline = None if mode.duration_s is None else start + mode.duration_s
    hard_deadline = None if launch_deadline is None else launch_deadline + mode.request_timeout_s + 1.0

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=mode.concurrency or 100)
    # NOTE: trust_env=False: no proxy from the environment may reroute the load away from the target.
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(mode.request_timeout_s), limits=limits, trust_env=False
    ) as client:

        async def one(rec: RequestRecord, body: bytes) -> None:
            nonlocal active
            try:
                await send_request(client, url, headers, body, rec, mode.request_timeout_s, start)
            except asyncio.CancelledError:
                rec.fail("cancelled", f"cancelled by the run's stop or deadline ({_stage(rec)})")
                raise
            finally:
                active -= 1
                slot_free.set()

        async def report() -> None:
            while True:
                await asyncio.sleep(progress_every_s)
                finished = [r for r in records if r.e2e_s is not None]
                bad = sum(not r.ok for r in finished)
                print(
                    f"[load] {time.perf_counter() - start:6.1f} s  {len(finished)}/{len(trace.requests)} done"
                    f"  {active} in flight  {bad} failed",
                    file=sys.stderr,
                    flush=True,
                )

        reporter = asyncio.create_task(report()) if progress_every_s else None
        try:
            for i, req in enumerate(trace.requests):
                if rate is not None:
                    delay = start + req.t_unit / rate - time.perf_counter()
                    if delay > 0 and not await _race(asyncio.sleep(delay), stop, launch_deadline):
                        break
                while mode.concurrency is not None and active >= mode.concurrency:
                    slot_free.clear()
                    if not await _race(slot_free.wait(), stop, launch_deadline):
                        break
                if stop.is_set() or (launch_deadline is not None and time.perf_counter() >= launch_deadline):
                    break
                if mode.concurrency is not None and active >= mode.concurrency:
                    break
                rec = RequestRecord(i, scheduled_s=None if rate is None else req.t_unit / rate)
                body = build_body(req, images, target)  # before the request's clock starts
                records.append(rec)
                active += 1
                task = asyncio.create_task(one(rec, body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks and not await _race(asyncio.wait(set(tasks)), stop, hard_deadline):
                for t in list(tasks):
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if reporter is not None:
                reporter.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return RunResult(mode, records, len(trace.requests), time.perf_counter() - start, stop.is_set())


# ---------------------------------------------------------------- metrics


def _dist(values: Sequence[float], scale: float = 1.0) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = (float(x) for x in np.percentile(a, [50, 90, 99]))
    return {
        "n": int(a.size),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "mean": float(a.mean()),
        "max": float(a.max()),
    }


def meets_slo(rec: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A successful request within both SLOs. A request with no content token is held to the TTFT SLO by
    its e2e latency; one with a single token has no TPOT and passes that SLO."""
    if not rec.ok:
        return False
    if slo_ttft_ms is not None:
        first = rec.ttft_s if rec.ttft_s is not None else rec.e2e_s
        if first is None or first * 1e3 > slo_ttft_ms:
            return False
    tpot = rec.tpot_s
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarize(
    records: Sequence[RequestRecord],
    *,
    duration_s: float | None = None,
    planned: int | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """Latency distributions (ms), throughputs (per second of ``duration_s``), goodput, errors, headers.

    ``duration_s`` defaults to the span from the run's start to the last request's end."""
    if duration_s is None:
        ends = [r.start_s + r.e2e_s for r in records if r.start_s is not None and r.e2e_s is not None]
        duration_s = max(ends, default=0.0)
    ok = [r for r in records if r.ok]

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    out_tokens = sum(r.output_tokens for r in ok)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok) if has_slo else None

    errors: dict[str, dict] = {}
    for r in records:
        if r.ok:
            continue
        key = f"{r.error_kind} {r.status}" if r.status is not None else str(r.error_kind)
        e = errors.setdefault(key, {"count": 0, "latency": [], "retry_after": Counter(), "example": r.error})
        e["count"] += 1
        if r.e2e_s is not None:
            e["latency"].append(r.e2e_s)
        if "retry-after" in r.headers:
            e["retry_after"][r.headers["retry-after"]] += 1
    for e in errors.values():
        e["latency_ms"] = _dist(e.pop("latency"), 1e3)
        e["retry_after"] = dict(e["retry_after"])

    header_values: dict[str, Counter] = {}
    for r in ok:
        for k, v in r.headers.items():
            if k != "retry-after":
                header_values.setdefault(k, Counter())[v] += 1

    usage = [r.usage for r in ok if r.usage]
    prompt_tokens = [u["prompt_tokens"] for u in usage if isinstance(u.get("prompt_tokens"), int)]
    cached = [
        (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        for u in usage
        if isinstance((u.get("prompt_tokens_details") or {}).get("cached_tokens"), int)
    ]
    visual = [v for u in usage for v in u.get("visual_tokens") or () if isinstance(v, int)]
    levels = Counter(str(v) for u in usage for v in u.get("visual_levels") or ())
    lag = [r.start_s - r.scheduled_s for r in records if r.scheduled_s is not None and r.start_s is not None]
    return {
        "planned": len(records) if planned is None else planned,
        "sent": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(out_tokens),
        "goodput": None if good is None else per_s(good),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "met": good},
        "ttft_ms": _dist([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        "tpot_ms": _dist([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        "itl_ms": _dist([x for r in ok for x in r.itl_s], 1e3),
        "e2e_ms": _dist([r.e2e_s for r in ok if r.e2e_s is not None], 1e3),
        "output_tokens": {"total": out_tokens, "mean": out_tokens / len(ok) if ok else None},
        "prompt_tokens_mean": float(np.mean(prompt_tokens)) if prompt_tokens else None,
        "cached_prompt_share": sum(cached) / sum(prompt_tokens) if cached and sum(prompt_tokens) else None,
        # vlmserve's usage extension: visual tokens per image, which the visual budget lowers under load
        "visual_tokens_per_image": _dist(visual),
        "visual_levels": dict(sorted(levels.items())),  # per image; 0 = full resolution
        "errors": errors,
        "headers": {k: dict(sorted(c.items())) for k, c in sorted(header_values.items())},
        "send_lag_ms": _dist(lag, 1e3),
    }


# ---------------------------------------------------------------- reporting


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(s: dict, title: str) -> str:
    lines = [title]
    lines.append(
        f"  requests: {s['ok']} ok / {s['sent']} sent / {s['planned']} planned, {s['failed']} failed"
        f"   duration {s['duration_s']:.2f} s"
    )
    tput = (
        f"  throughput: {s['request_throughput']:.3f} req/s, {s['output_token_throughput']:.1f} output tok/s"
        f" ({s['output_tokens']['total']} tokens)"
    )
    if s["goodput"] is not None:
        slo = " ".join(
            f"{name}<={s['slo'][key]:g}ms"
            for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))
            if s["slo"][key] is not None
        )
        tput += f"   goodput ({slo}): {s['goodput']:.3f} req/s, {s['slo']['met']}/{s['sent']} met"
    lines.append(tput)
    lines.append(f"  {'ms':<6}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}{'n':>7}")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        d = s[key]
        lines.append(
            f"  {name:<6}{_f(d['p50']):>10}{_f(d['p90']):>10}{_f(d['p99']):>10}{_f(d['mean']):>10}{d['n']:>7}"
        )
    if s["send_lag_ms"]["n"] and s["send_lag_ms"]["p99"] > 50:
        lines.append(
            f"  NOTE: sends ran late (p99 {s['send_lag_ms']['p99']:.0f} ms behind schedule): the client is a bottleneck"
        )
    for key, e in sorted(s["errors"].items(), key=lambda kv: -kv[1]["count"]):
        lat = e["latency_ms"]
        extra = f", Retry-After {e['retry_after']}" if e["retry_after"] else ""
        line = (
            f"  error {key}: {e['count']} (latency p50 {_f(lat['p50'])} ms, max {_f(lat['max'])} ms{extra})"
        )
        lines.append(f"{line}  e.g. {e['example']!r}"[:240])
    extras = []
    if s["prompt_tokens_mean"] is not None:
        extras.append(f"prompt tokens mean {s['prompt_tokens_mean']:.0f}")
    if s["cached_prompt_share"] is not None:
        extras.append(f"cached {100 * s['cached_prompt_share']:.0f}% of prompt tokens")
    if s["visual_tokens_per_image"]["n"]:
        v = s["visual_tokens_per_image"]
        extras.append(f"visual tokens/image p50 {v['p50']:.0f} mean {v['mean']:.0f} max {v['max']:.0f}")
    if s["visual_levels"]:
        extras.append("visual levels " + ", ".join(f"{v} ×{n}" for v, n in s["visual_levels"].items()))
    if extras:
        lines.append("  usage: " + ", ".join(extras))
    for k, counts in s["headers"].items():
        lines.append(f"  {k}: " + ", ".join(f"{v} ×{n}" for v, n in counts.items()))
    return "\n".join(lines)


def format_sweep(runs: Sequence[tuple[LoadMode, dict]]) -> str:
    head = f"{'mode':<28}{'req/s':>8}{'goodput':>9}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'failed':>8}"
    rows = [head]
    for mode, s in runs:
        rows.append(
            f"{mode.label():<28}{s['request_throughput']:>8.3f}{_f(s['goodput'], '.3f'):>9}"
            f"{s['output_token_throughput']:>9.1f}{_f(s['ttft_ms']['p50']):>10}{_f(s['ttft_ms']['p99']):>10}"
            f"{_f(s['tpot_ms']['p50']):>10}{s['failed']:>8}"
        )
    return "\n".join(rows)


def write_plots(results: Sequence[RunResult], summaries: Sequence[dict], plot_dir: str | Path) -> list[Path]:
    """Latency CDFs (TTFT, e2e), one line per run; goodput and throughput against rate for a sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, getter in (("ttft", lambda r: r.ttft_s), ("e2e", lambda r: r.e2e_s)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for res in results:
            vals = np.sort([getter(r) * 1e3 for r in res.records if r.ok and getter(r) is not None])
            if vals.size:
                ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=res.mode.label())
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name.upper()} CDF (successful requests)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        written.append(plot_dir / f"{name}_cdf.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    points = [
        (res.mode.rate, s)
        for res, s in zip(results, summaries)
        if res.mode.rate and math.isfinite(res.mode.rate)
    ]
    if len(points) >= 2:
        points.sort(key=lambda p: p[0])
        rates = [p[0] for p in points]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(rates, [s["request_throughput"] for _, s in points], "o-", label="throughput")
        if points[0][1]["goodput"] is not None:
            ax.plot(rates, [s["goodput"] for _, s in points], "s-", label="goodput (within SLOs)")
        ax.plot(rates, rates, ":", color="gray", label="offered")
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("requests/s")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("goodput against rate")
        fig.tight_layout()
        written.append(plot_dir / "goodput_vs_rate.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def _machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


# ---------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="load.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    g.add_argument("--model", help="model name (default: the first one GET /models lists)")
    g.add_argument("--api-key")
    g.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --base-url")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM's ignore_eos)"
    )
    g.add_argument(
        "--dialect",
        choices=["openai", "transformers"],
        default="openai",
        help="request fields the server takes: openai (+vLLM extensions; vlmserve, vLLM, SGLang) or "
        "transformers (`transformers serve`: no stream_options, --ignore-eos as min_new_tokens)",
    )
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request")

    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (inf: all at once)")
    g.add_argument(
        "--rates",
        help="sweep: comma-separated rates, one run each; run k uses the trace's spec with seed + k "
        "(cold caches at every rate) unless --sweep-same-trace",
    )
    g.add_argument("--sweep-same-trace", action="store_true", help="replay the very same trace at every rate")
    g.add_argument("--concurrency", type=int, help="fixed in-flight clients (with --rate: a cap)")
    g.add_argument(
        "-n", "--num-requests", type=int, help="requests in the trace (default 64; with --trace: its first N)"
    )
    g.add_argument("--duration-s", type=float, help="start no request after this many seconds")
    g.add_argument("--request-timeout-s", type=float, default=120.0)
    g.add_argument(
        "--warmup", type=int, default=0, help="unmeasured 224x224 requests sent first, one at a time"
    )

    g = p.add_argument_group("trace")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trace", help="replay a trace file instead of drawing one")
    g.add_argument("--save-trace", help="write the trace (with image digests) here")
    g.add_argument("--generate-only", action="store_true", help="make the trace and images, then exit")
    g.add_argument("--resolutions", default=DEFAULT_RESOLUTIONS, help="WxH[:weight],...")
    g.add_argument("--formats", default="jpeg,png", help="jpeg|png[:weight],...")
    g.add_argument("--images-per-request", default="1", help="count[:weight],... e.g. 0:1,1:6,2:2")
    g.add_argument(
        "--repeat-share", type=float, default=0.0, help="chance an image slot reuses an earlier image"
    )
    g.add_argument("--detail", default="none", help="auto|low|high|none[:weight],... (none: omit the field)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--max-tokens-range", help="LO,HI: uniform max_tokens (overrides --max-tokens)")
    g.add_argument("--prompt-words", default="0", help="LO,HI filler words before each question")
    g.add_argument("--jpeg-quality", default="80,95", help="LO,HI")
    g.add_argument("--image-cache-dir", help="keep generated images here between invocations")
    g.add_argument("--image-workers", type=int, default=2)

    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float)
    g.add_argument("--slo-tpot-ms", type=float)
    g.add_argument("--out", help="results JSON (config, trace digest, per-request records, summaries)")
    g.add_argument("--plot-dir", help="PNG plots: ttft_cdf, e2e_cdf, goodput_vs_rate (with --rates)")
    g.add_argument("--progress-s", type=float, default=10.0, help="progress line every N s (0: none)")
    args = p.parse_args(argv)
    if not args.generate_only and args.rate is None and args.rates is None and args.concurrency is None:
        p.error("give --rate, --rates or --concurrency")
    if args.rate is not None and args.rates is not None:
        p.error("--rate and --rates are exclusive")
    return args


def trace_from_args(args: argparse.Namespace) -> Trace:
    if args.trace:
        trace = load_trace(args.trace)
        return trace.head(args.num_requests) if args.num_requests else trace
    formats = parse_weighted(args.formats)
    details = parse_weighted(args.detail)
    if bad := set(formats) - {"jpeg", "png"}:
        raise ValueError(f"unknown formats {sorted(bad)}")
    if bad := set(details) - {"auto", "low", "high", "none"}:
        raise ValueError(f"unknown detail values {sorted(bad)}")
    resolutions = parse_weighted(args.resolutions)
    for r in resolutions:
        parse_resolution(r)
    ipr = parse_weighted(args.images_per_request)
    for k in ipr:
        if int(k) < 0:
            raise ValueError("images per request must be >= 0")
    spec = TraceSpec(
        num_requests=args.num_requests or 64,
        seed=args.seed,
        resolutions=resolutions,
        formats=formats,
        images_per_request=ipr,
        repeat_share=args.repeat_share,
        detail=details,
        max_tokens=parse_range(args.max_tokens_range)
        if args.max_tokens_range
        else (args.max_tokens, args.max_tokens),
        prompt_words=parse_range(args.prompt_words),
        jpeg_quality=parse_range(args.jpeg_quality),
    )
    return make_trace(spec)


def _warmup_trace(n: int) -> Trace:
    spec = TraceSpec(num_requests=n, seed=2**31 - 1, resolutions={"224x224": 1.0}, formats={"jpeg": 1.0})
    spec.max_tokens = (8, 8)
    return make_trace(spec)


def sibling_trace(trace: Trace, k: int) -> Trace:
    """The trace's spec drawn with seed + k: the same mix and length, other images and prompts. A sweep
    runs one per rate, so a server's prefix and embedding caches don't carry one rate into the next."""
    spec = TraceSpec(**{**trace.spec, "seed": trace.spec["seed"] + k, "num_requests": len(trace.requests)})
    return make_trace(spec)


def _prepare(trace: Trace, args: argparse.Namespace) -> tuple[ImageStore, dict]:
    t = time.perf_counter()
    images = ImageStore(trace, args.image_cache_dir)
    images.prepare(args.image_workers)
    info = {
        "digest": trace.digest(),
        "spec": trace.spec,
        "requests": len(trace.requests),
        "images": len(trace.images),
        "image_bytes": images.total_bytes,
        "image_digests_match": not images.mismatched,
    }
    print(
        f"trace {info['digest'][:12]}: {len(trace.requests)} requests, {len(trace.images)} images "
        f"({images.total_bytes / 1e6:.1f} MB encoded), ready in {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
    )
    if images.mismatched:
        print(
            f"WARNING: {len(images.mismatched)} images differ from the trace file's digests "
            "(another Pillow/numpy build?); requests are not byte-identical to the recorded trace",
            file=sys.stderr,
        )
    return images, info


async def amain(args: argparse.Namespace, stop: asyncio.Event | None = None) -> dict:
    """The CLI's body: draw or load the trace, run each rate, print, write JSON and plots."""
    stop = stop or asyncio.Event()
    check_loopback(args.base_url, args.allow_remote)
    trace = trace_from_args(args)
    images, trace_info = _prepare(trace, args)
    trace_info["path"] = args.trace
    if args.save_trace:
        save_trace(trace, args.save_trace)
    if args.generate_only:
        return {"trace": trace_info}

    model = args.model or await discover_model(args.base_url, args.api_key, allow_remote=args.allow_remote)
    target = Target(
        args.base_url,
        model,
        args.api_key,
        args.temperature,
        args.ignore_eos,
        args.extra_body,
        args.allow_remote,
        args.dialect,
    )
    if args.warmup:
        wt = _warmup_trace(args.warmup)
        wi = ImageStore(wt)
        wi.prepare(1)
        warm = await run_load(
            wt, wi, target, LoadMode(concurrency=1, request_timeout_s=args.request_timeout_s), stop=stop
        )
        bad = [r for r in warm.records if not r.ok]
        print(f"warm-up: {len(warm.records) - len(bad)}/{len(warm.records)} ok", file=sys.stderr)
        for r in bad[:3]:
            print(f"  warm-up error: {r.error_kind} {r.status}: {r.error}", file=sys.stderr)

    rates: list[float | None] = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    results: list[RunResult] = []
    summaries: list[dict] = []
    run_traces: list[dict] = []
    for k, rate in enumerate(rates):
        if stop.is_set():
            break
        run_trace, run_images, info = trace, images, trace_info
        if k and not args.sweep_same_trace:
            run_trace = sibling_trace(trace, k)
            run_images, info = _prepare(run_trace, args)
        run_traces.append(info)
        mode = LoadMode(rate, args.concurrency, args.duration_s, args.request_timeout_s)
        res = await run_load(
            run_trace, run_images, target, mode, stop=stop, progress_every_s=args.progress_s or None
        )
        s = summarize(
            res.records,
            duration_s=res.duration_s,
            planned=res.planned,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
        )
        results.append(res)
        summaries.append(s)
        title = f"{args.base_url} model={model} {mode.label()}" + (
            "  [INTERRUPTED: partial]" if res.interrupted else ""
        )
        print(format_summary(s, title), flush=True)
    if len(results) > 1:
        print(format_sweep([(r.mode, s) for r, s in zip(results, summaries)]))

    out = {
        "tool": "benchmarks/load.py",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(),
        "config": {k: v for k, v in vars(args).items()},
        "target": {"base_url": args.base_url, "model": model},
        "trace": trace_info,
        "runs": [
            {
                "mode": asdict(r.mode),
                "trace_digest": info["digest"],
                "interrupted": r.interrupted,
                "summary": s,
                "records": [rec.to_json() for rec in r.records],
            }
            for r, s, info in zip(results, summaries, run_traces)
        ],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=float) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot_dir and results:
        for path in write_plots(results, summaries, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_loopback(args.base_url, args.allow_remote)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def runner() -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()

        def on_sigint() -> None:
            if stop.is_set():  # a second Ctrl-C: no partial summary, just out
                me.cancel()
                return
            print("\ninterrupted: stopping, partial summary follows (Ctrl-C again to abort)", file=sys.stderr)
            stop.set()

        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        return await amain(args, stop)

    try:
        out = asyncio.run(runner())
    except asyncio.CancelledError:
        return 130
    runs = out.get("runs", [])
    return 130 if any(r["interrupted"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
