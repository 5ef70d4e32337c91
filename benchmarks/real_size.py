"""vlmserve at the size users deploy, against the machine's measured limits and llama.cpp's ``llama-server``.

Issue 51's table, re-measured for one Hugging Face checkpoint (``make-model --preset qwen2-vl-2b`` and the like),
one run, one machine:

- **machine**: CPU model and its avx2/avx512*/amx* flags; read bandwidth (``torch.sum`` over a float32 buffer of
  at least 1 GiB and 4× the L3, best of several) and bf16/fp32 matmul GFLOP/s at a prefill shape (2048 ×
  hidden × intermediate), measured before and after the servers (this VM's rates drift). The decode floor is
  the bytes one step must read (every decoder tensor, the output projection once; an untied input embedding
  only gives one row a token, so it is left out) over that bandwidth.
- **servers**, vlmserve then the peer, never both at once, each on 127.0.0.1: spawn → ``/health`` 200, the
  ``start-up N s: phase N s, ...`` log line where the server writes one, resident memory of the process tree
  (after warm-up, after the load, the peak sampled meanwhile), the KV pool from ``/metrics``.
- **decode**: greedy with ``ignore_eos``, ms per token from the stream's per-token gaps (median, p90) for one
  stream and for ``--streams`` concurrent ones, aggregate tokens/s. **prefill**: a ``--prefill-tokens`` text
  prompt, TTFT and prompt tokens/s. **images**: mixed-resolution PNG requests all at once, req/s, p50 TTFT.
- **tower** (in-process, no server): a 1024² image through the checkpoint's vision tower and a
  ``--prefill-tokens`` prefill through its decoder, built as the engine builds them, in bf16 and fp32:
  GFLOP/s against the matmul rate of the same run (issue 51's target: ≥ 75 %).

    .venv/bin/python benchmarks/real_size.py --model /work/ckpt/qwen2-vl-2b                 # everything, llama.cpp peer
    .venv/bin/python benchmarks/real_size.py --model /work/ckpt/qwen2.5-vl-7b --streams 1 --skip prefill,tower
    .venv/bin/python benchmarks/real_size.py --model /tmp/rs/tiny --quick --peer none      # smoke run (seconds)

JSON to ``benchmarks/results/real_size/<label>-<YYYYMMDD-HHMM>.json``, server logs to ``benchmarks/out/real_size/``,
a summary table with the ratios on stdout, progress on stderr.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import base64
import contextlib
import gc
import json
import math
import os
import re
import statistics
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks import harness, llamacpp, load

ROOT = Path(__file__).resolve().parents[1]

SECTIONS = ("machine", "decode", "prefill", "tower", "images")
RESULTS_DIR = ROOT / "benchmarks" / "results" / "real_size"
LOG_DIR = ROOT / "benchmarks" / "out" / "real_size"
# (width, height): square, 4:3 both ways, 16:9, small to large; the first n are used.
IMAGE_SIZES = (
    (224, 224),
    (448, 448),
    (640, 480),
    (1024, 768),
    (336, 336),
    (480, 640),
    (800, 600),
    (1280, 720),
)
FULL = {
    "tokens": 64,
    "streams": "1,8,16",
    "prefill_tokens": 2000,
    "images": 8,
    "image_tokens": 32,
    "repeats": 3,
}
QUICK = {"tokens": 16, "streams": "1,4", "prefill_tokens": 256, "images": 2, "image_tokens": 8, "repeats": 1}
GIB = 2**30
RSS_BOUND_SLACK = int(1.5e9)  # issue 51: resident memory within weights + KV pool + 1.5 GB
STARTUP_LINE = re.compile(r"start-up ([0-9.]+) s: (.*)")
_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[real_size {time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("--peer", choices=("none", "llamacpp"), default="llamacpp")
    p.add_argument("--label", help="name of the result file (default: the checkpoint directory's name)")
    p.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {','.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run of the harness")
    p.add_argument("--tokens", type=int, help=f"decode tokens per request ({FULL['tokens']})")
    p.add_argument("--streams", help=f"concurrent decode streams, comma-separated ({FULL['streams']})")
    p.add_argument("--prefill-tokens", type=int, help=f"prefill prompt length ({FULL['prefill_tokens']})")
    p.add_argument("--images", type=int, help=f"image requests sent at once ({FULL['images']}, at most 8)")
    p.add_argument(
        "--image-tokens", type=int, help=f"tokens generated per image request ({FULL['image_tokens']})"
    )
    p.add_argument("--repeats", type=int, help=f"one-stream decode and prefill requests ({FULL['repeats']})")
    p.add_argument(
        "--vlmserve-arg", action="append", default=[], metavar="X", help="passed to vlmserve serve"
    )
    p.add_argument("--llamacpp-arg", action="append", default=[], metavar="X", help="passed to llama-server")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--log-dir", type=Path, default=LOG_DIR)
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.streams = sorted({int(s) for s in str(args.streams).split(",") if s.strip()})
    except ValueError:
        p.error(f"--streams: comma-separated integers, got {args.streams!r}")
    if not args.streams or min(args.streams) < 1:
        p.error("--streams: at least one count, each ≥ 1")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := skip - set(SECTIONS):
        p.error(f"--skip: unknown section(s) {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    args.skip = skip
    if not 1 <= args.images <= len(IMAGE_SIZES):
        p.error(f"--images: 1..{len(IMAGE_SIZES)}")
    if min(args.tokens, args.prefill_tokens, args.image_tokens, args.repeats) < 1:
        p.error("--tokens, --prefill-tokens, --image-tokens and --repeats must be ≥ 1")
    args.label = args.label or args.model.resolve().name
    return args


# ---------------------------------------------------------------- machine


def cpu_info(cpuinfo: str | None = None) -> dict:
    """Model name and the vector/matrix flags that decide the fast paths (avx2, avx512*, amx*)."""
    if cpuinfo is None:
        with contextlib.suppress(OSError):
            cpuinfo = Path("/proc/cpuinfo").read_text()
    model = None
    for line in (cpuinfo or "").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    flags = [f for f in llamacpp.cpu_flags(cpuinfo or "") if f == "avx2" or f.startswith(("avx512", "amx"))]
    return {"cpu_model": model, "flags": flags}


def l3_bytes() -> int | None:
    """The largest cache's size (index3 on x86), from sysfs."""
    sizes = []
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = p.read_text().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes) if sizes else None


def meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(value.split()[0]) * 1024
    return out


def bf16_fast(flags: Sequence[str]) -> bool:
    # NOTE: without these a bf16 matmul is emulated, ~100× slower than fp32 (minutes at a prefill shape).
    return "avx512_bf16" in flags or "amx_bf16" in flags


def read_bandwidth(nbytes: int, repeat: int) -> dict:
    """GB/s of ``torch.sum`` over a float32 buffer of ``nbytes`` (touched first), best of ``repeat``."""
    import torch

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    times = harness.time_each(buf.sum, repeat)
    del buf
    gc.collect()
    return {
        "buffer_bytes": nbytes,
        "gbs": nbytes / min(times) / 1e9,
        "all_gbs": [nbytes / t / 1e9 for t in times],
    }


def matmul_gflops(dtype_name: str, shape: tuple[int, int, int], repeat: int) -> float:
    """GFLOP/s of an (m, k) @ (k, n) matmul in ``dtype_name``, best of ``repeat`` after one warm-up."""
    import torch

    m, k, n = shape
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best / 1e9


def matmul_shape(model_dir: Path) -> tuple[int, int, int]:
    """2048 tokens × hidden × intermediate (the decoder's MLP up-projection): a prefill's typical GEMM. Test
    presets' dimensions are raised to 1024, below which the rate says nothing about the machine."""
    cfg = text_config(model_dir)
    return (2048, max(1024, int(cfg["hidden_size"])), max(1024, int(cfg["intermediate_size"])))


def measure_machine(model_dir: Path, flags: Sequence[str], quick: bool) -> dict:
    import torch

    l3 = l3_bytes() or 0
    nbytes = (256 << 20) if quick else max(1 << 30, 4 * l3)
    bw = read_bandwidth(nbytes, 3 if quick else 7)
    shape = matmul_shape(model_dir)
    matmul: dict[str, float | None] = {}
    for name in ("bfloat16", "float32"):
        if name == "bfloat16" and not bf16_fast(flags):
            matmul[name] = None
            continue
        matmul[name] = matmul_gflops(name, shape, 2 if quick else 5)
    return {
        "read_gbs": bw["gbs"],
        "read_all_gbs": bw["all_gbs"],
        "buffer_bytes": nbytes,
        "matmul_shape": list(shape),
        "matmul_gflops": matmul,
        "torch_threads": torch.get_num_threads(),
        "mem_available": meminfo().get("MemAvailable"),
        "loadavg_1m": os.getloadavg()[0],
    }


# ---------------------------------------------------------------- weights and the decode floor


def text_config(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {**cfg, **(cfg.get("text_config") or {})}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, byte offsets), without reading the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def is_vision_tensor(name: str) -> bool:
    """``visual.*`` (Qwen2-VL's layout) or ``model.visual.*`` (transformers 5's)."""
    return "visual" in name.split(".")[:2]


def weight_bytes(model_dir: Path) -> dict:
    """Bytes of the checkpoint's tensors, from the safetensors headers: all, the tower's, the decoder's (each
    stored tensor once, so a tied embedding counts once), and ``floor_bytes``, what one decode step reads: the
    decoder less an untied input embedding (a step gathers one of its rows per token; the output projection,
    ``lm_head`` or the tied embedding, is read whole). A tied checkpoint that stores ``lm_head`` anyway counts
    it once. The shards an index names, else every ``*.safetensors``."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        files = [
            Path(model_dir) / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
    else:
        files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    total = vision = embed = head = params = head_params = 0
    for f in files:
        for name, t in safetensors_header(f).items():
            size = t["data_offsets"][1] - t["data_offsets"][0]
            total += size
            if is_vision_tensor(name):
                vision += size
                continue
            params += math.prod(t["shape"])
            if name.endswith("embed_tokens.weight"):
                embed += size
            elif name.split(".")[-2:] == ["lm_head", "weight"]:
                head, head_params = head + size, head_params + math.prod(t["shape"])
    decoder = total - vision
    tied = head == 0 or bool(text_config(model_dir).get("tie_word_embeddings"))
    if tied and head and embed:  # the same matrix twice on disk, once in memory
        decoder, params, head = decoder - head, params - head_params, 0
    return {
        "files": len(files),
        "total_bytes": total,
        "vision_bytes": vision,
        "decoder_bytes": decoder,
        "decoder_params": params,
        "embedding_bytes": embed,
        "lm_head_bytes": embed if tied else head,
        "tied": tied,
        "floor_bytes": decoder if tied else decoder - embed,
    }


def floor_ms(floor_bytes: int, gbs: float | None) -> float | None:
    return None if not gbs else floor_bytes / (gbs * 1e9) * 1e3


# ---------------------------------------------------------------- process memory and the start-up line


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid, fields in harness.proc_stats():
        kids.setdefault(int(fields[1]), []).append(pid)
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def tree_rss(pid: int) -> dict:
    """VmRSS of ``pid`` and of all its descendants, summed (pages the processes share count in each)."""
    per = {p: r for p in process_tree(pid) if (r := vm_rss(p)) is not None}
    return {"bytes": sum(per.values()), "processes": len(per), "main_bytes": per.get(pid)}


class RssSampler:
    """The largest summed tree RSS seen, polled from a thread while the load runs."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid)["bytes"])
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def parse_startup(log_text: str) -> dict | None:
    """The last ``start-up T s: name N s, name N s`` line: its total and phases (a phase that does not read as
    ``name N s`` keeps its text under ``unparsed``); None where the server wrote no such line."""
    found = None
    for line in log_text.splitlines():
        if m := STARTUP_LINE.search(line):
            found = m
    if found is None:
        return None
    phases, unparsed = {}, []
    for part in found.group(2).split(", "):
        if m := re.fullmatch(r"\s*(.+?)\s+([0-9.]+)\s*s\s*", part):
            phases[m.group(1)] = float(m.group(2))
        elif part.strip():
            unparsed.append(part.strip())
    out = {"total_s": float(found.group(1)), "phases": phases}
    if unparsed:
        out["unparsed"] = unparsed
    return out


_LLAMA_KV = re.compile(r"KV buffer size\s*=\s*([0-9.]+)\s*MiB")


def llamacpp_kv_bytes(log_text: str) -> int | None:
    """llama-server's KV buffers, as its log states them (one line per buffer)."""
    sizes = [float(m.group(1)) for m in _LLAMA_KV.finditer(log_text)]
    return int(sum(sizes) * 2**20) if sizes else None


# ---------------------------------------------------------------- one streamed request


@dataclass(slots=True)
class Stream:
    """One streamed chat request: when each event that carried tokens came (seconds from the send) and how
    many it carried."""

    status: int | None = None
    events: list[tuple[float, int]] = field(default_factory=list)
    e2e_s: float | None = None
    usage: dict | None = None
    timings: dict | None = None  # llama-server's own figures (its last event's)
    error: str | None = None
    _predicted: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and bool(self.events)

    @property
    def ttft_s(self) -> float | None:
        return self.events[0][0] if self.events else None

    @property
    def tokens(self) -> int:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return sum(n for _, n in self.events)

    @property
    def prompt_tokens(self) -> int | None:
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            return self.usage["prompt_tokens"]
        return (self.timings or {}).get("prompt_n")  # llama-server's count, where it sent no usage

    def token_gaps_s(self) -> list[float]:
        """One gap per token after the first event: an event that carried n tokens gives n gaps of 1/n its
        distance from the previous event."""
        gaps = []
        for (t0, _), (t1, n) in zip(self.events, self.events[1:]):
            gaps += [(t1 - t0) / n] * n
        return gaps

    def on_event(self, obj: dict, t: float) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        choices = obj.get("choices") or []
        if any("token_ids" in c for c in choices):  # vlmserve's return_token_ids (vLLM's extension)
            n = sum(len(c.get("token_ids") or ()) for c in choices)
        elif self.timings is not None and "predicted_n" in self.timings:  # llama-server's timings_per_token
            n = max(0, int(self.timings["predicted_n"]) - self._predicted)
            self._predicted += n
        else:
            n = sum(1 for c in choices if (c.get("delta") or {}).get("content"))
        if n:
            self.events.append((t, n))


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict, timeout_s: float, rec: Stream | None = None
) -> Stream:
    """POST one streaming request and time its events into ``rec``; never raises for a server fault."""
    rec = rec if rec is not None else Stream()
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    break
                rec.on_event(obj, time.perf_counter() - t0)
    except (TimeoutError, httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.e2e_s = time.perf_counter() - t0
    return rec


@dataclass(slots=True)
class Server:
    """What the driver needs of a running server: where, what model id, and its dialect's extra fields."""

    name: str
    base_url: str
    model: str
    extra: dict  # fields that make the stream count its tokens (see Stream.on_event)
    timeout_s: float = 900.0

    def body(self, content, max_tokens: int) -> dict:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # vLLM's extension, and llama-server's own field
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra,
        }

    async def run(self, bodies: list[dict], report_every_s: float = 15.0) -> tuple[list[Stream], float]:
        """All ``bodies`` at once; their streams and the wall time until the last ended. A run longer than
        ``report_every_s`` says how far it got, every ``report_every_s``."""
        url = self.base_url + "/v1/chat/completions"
        recs = [Stream() for _ in bodies]

        async def report() -> None:
            while True:
                await asyncio.sleep(report_every_s)
                done = sum(r.e2e_s is not None for r in recs)
                tokens = sum(n for r in recs for _, n in r.events)
                progress(f"{self.name}:   {done}/{len(recs)} requests done, {tokens} tokens streamed so far")

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(bodies))
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False) as client:
            reporter = asyncio.create_task(report())
            t0 = time.perf_counter()
            try:
                await asyncio.gather(
                    *(stream_chat(client, url, b, self.timeout_s, r) for b, r in zip(bodies, recs))
                )
            finally:
                reporter.cancel()
            return recs, time.perf_counter() - t0


# ---------------------------------------------------------------- prompts and images


def text_of_tokens(model_dir: Path, n: int, seed: int) -> str:
    """Plain English-like text that the checkpoint's tokenizer cuts into ``n`` tokens (the chat template adds
    its own few); the seed makes each prompt differ from its first word, so no prefix cache serves it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    words = load.FILLER
    text = f"Note {seed}:"
    while True:
        text += " " + " ".join(rng.choice(words, size=max(16, n)))
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc.ids) >= n:
            return text[: enc.offsets[n - 1][1]]


def decode_prompt(i: int) -> str:
    return f"Story {i}: write a long story about a lighthouse keeper and the sea, in many short chapters."


def image_content(width: int, height: int, seed: int, prompt: str) -> list[dict]:
    data = load.synth_image(width, height, "png", seed=seed)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": prompt}]


def image_tokens(model_dir: Path, sizes: Sequence[tuple[int, int]]) -> list[int]:
    """Visual tokens each image becomes after the checkpoint's smart-resize (patches / merge²)."""
    from preprocess import PreprocessConfig, smart_resize

    pp = PreprocessConfig.from_checkpoint(model_dir)
    out = []
    for w, h in sizes:
        rh, rw = smart_resize(h, w, pp.factor, pp.min_pixels, pp.max_pixels)
        out.append(rh * rw // pp.factor**2)
    return out


# ---------------------------------------------------------------- the load on one server


def _pct(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    return float(np.percentile(np.asarray(values) * scale, q)) if values else None


def _errors(streams: Sequence[Stream]) -> list[str]:
    return [s.error or f"HTTP {s.status}, {len(s.events)} token events" for s in streams if not s.ok]


def decode_summary(streams: Sequence[Stream], wall_s: float) -> dict:
    """ms per token: ``mean`` is each stream's decode time over its tokens (what a reply takes), the headline;
    p50/p90 are of the per-token gaps, which a server that sends tokens in bursts pulls towards 0; ``e2e`` is
    request time over tokens, TTFT included: an upper bound that bursts cannot hide."""
    gaps = [g for s in streams if s.ok for g in s.token_gaps_s()]
    return {
        "streams": len(streams),
        "ok": sum(s.ok for s in streams),
        "ms_per_token_p50": _pct(gaps, 50, 1e3),
        "ms_per_token_p90": _pct(gaps, 90, 1e3),
        "ms_per_token_mean": float(np.mean(gaps) * 1e3) if gaps else None,
        "ms_per_token_e2e": (
            sum(s.e2e_s for s in streams if s.ok) / sum(s.tokens for s in streams if s.ok) * 1e3
            if any(s.ok and s.tokens for s in streams)
            else None
        ),
        "tokens": sum(s.tokens for s in streams if s.ok),
        "tokens_per_event": (
            sum(n for s in streams for _, n in s.events) / max(1, sum(len(s.events) for s in streams))
        ),
        "aggregate_tokens_per_s": sum(s.tokens for s in streams if s.ok) / wall_s if wall_s else None,
        "ttft_p50_s": _pct([s.ttft_s for s in streams if s.ok], 50),
        "wall_s": wall_s,
        "peer_reported_ms_per_token": _pct(
            [
                s.timings["predicted_per_token_ms"]
                for s in streams
                if s.timings and "predicted_per_token_ms" in s.timings
            ],
            50,
        ),
        "errors": _errors(streams)[:3],
        "events": [
            [(round(t, 5), n) for t, n in s.events] for s in streams
        ],  # (s from send, tokens) per stream
    }


async def drive(
    srv: Server, model_dir: Path, args: argparse.Namespace, vision: bool, after_warmup=lambda: None
) -> dict:
    """Warm-up (then ``after_warmup()``), then each section not skipped, one after another; rows for the result."""
    out: dict = {}
    progress(f"{srv.name}: warm-up")
    warm = [srv.body(decode_prompt(-1), 8)]
    if vision and "images" not in args.skip:
        warm.append(srv.body(image_content(224, 224, 999_999, "What is in this picture?"), 4))
    for body in warm:  # one at a time: the first of each kind pays for lazy initialisation
        streams, wall = await srv.run([body])
        progress(f"{srv.name}: warm-up request {'ok' if streams[0].ok else _errors(streams)} in {wall:.1f} s")
    after_warmup()

    if "decode" not in args.skip:
        single = []
        for r in range(args.repeats):
            streams, wall = await srv.run([srv.body(decode_prompt(r), args.tokens)])
            single += streams
            progress(f"{srv.name}: one stream, {streams[0].tokens} tokens in {wall:.1f} s")
        rows = {"1": decode_summary(single, sum(s.e2e_s or 0 for s in single))}
        for k in (k for k in args.streams if k > 1):
            bodies = [srv.body(decode_prompt(100 * k + i), args.tokens) for i in range(k)]
            streams, wall = await srv.run(bodies)
            rows[str(k)] = decode_summary(streams, wall)
            progress(
                f"{srv.name}: {k} streams, {harness.fmt(rows[str(k)]['ms_per_token_mean'], '.1f')} ms/token, "
                f"{wall:.1f} s"
            )
        out["decode"] = rows

    if "prefill" not in args.skip:
        runs = []
        for r in range(args.repeats if not args.quick else 1):
            text = text_of_tokens(model_dir, args.prefill_tokens, seed=7000 + r)
            (s,), _ = await srv.run([srv.body(text, 1)])
            runs.append(s)
            progress(f"{srv.name}: prefill {s.prompt_tokens} tokens, TTFT {harness.fmt(s.ttft_s, '.2f')} s")
        ok = [s for s in runs if s.ok and s.prompt_tokens]
        best = min(ok, key=lambda s: s.ttft_s) if ok else None
        out["prefill"] = {
            "prompt_tokens": best.prompt_tokens if best else None,
            "ttft_s": best.ttft_s if best else None,
            "ttft_all_s": [s.ttft_s for s in runs],
            "tokens_per_s": best.prompt_tokens / best.ttft_s if best else None,
            "errors": _errors(runs)[:3],
        }

    if "images" not in args.skip:
        if not vision:
            out["images"] = {"skipped": "this server runs without a vision projector"}
        else:
            sizes = IMAGE_SIZES[: args.images]
            bodies = [
                srv.body(image_content(w, h, 1000 + i, "Describe this picture in detail."), args.image_tokens)
                for i, (w, h) in enumerate(sizes)
            ]
            progress(
                f"{srv.name}: {len(bodies)} image requests at once ({', '.join(f'{w}x{h}' for w, h in sizes)})"
            )
            streams, wall = await srv.run(bodies)
            ok = [s for s in streams if s.ok]
            out["images"] = {
                "requests": len(bodies),
                "ok": len(ok),
                "sizes": [list(s) for s in sizes],
                "wall_s": wall,
                "req_per_s": len(ok) / wall if ok else None,
                "ttft_p50_s": _pct([s.ttft_s for s in ok], 50),
                "prompt_tokens": [s.prompt_tokens for s in streams],
                "errors": _errors(streams)[:3],
            }
            progress(f"{srv.name}: images {len(ok)}/{len(bodies)} ok in {wall:.1f} s")
    return out


def _model_id(base_url: str) -> str:
    return asyncio.run(load.discover_model(base_url + "/v1"))


def measure(name: str, pid: int, srv: Server, model_dir: Path, args, vision: bool) -> dict:
    """``drive`` with the server's memory read: after warm-up, after the load, and its peak meanwhile."""
    rss: dict = {}
    # NOTE: the servers run in their own process groups (pgid = pid); what other processes took of the CPUs
    # meanwhile is recorded, since llama.cpp's spinning threads slow down many-fold beside a busy process.
    with RssSampler(pid) as sampler, harness.CpuMeter(pgid=pid) as meter:
        rows = asyncio.run(drive(srv, model_dir, args, vision, lambda: rss.update(tree_rss(pid))))
    rows["cpu"] = meter.result
    rows["rss_after_warmup"] = rss
    rows["rss_after_load"] = tree_rss(pid)
    rows["rss_peak_bytes"] = sampler.peak
    progress(f"{name}: RSS after the load {rows['rss_after_load']['bytes'] / 2**30:.2f} GiB")
    return rows


def run_vlmserve(model_dir: Path, args, stamp: str) -> dict:
    port = harness.free_port()
    argv = harness.vlmserve_here_argv(model_dir, port, args.vlmserve_arg)
    log_path = args.log_dir / f"{args.label}-{stamp}-vlmserve.log"
    proc = harness.ServerProcess("vlmserve", argv, port, log_path)
    res: dict = {"argv": argv, "log": str(log_path)}
    progress(f"vlmserve: starting (log {log_path})")
    try:
        proc.start(timeout_s=args.ready_timeout, poll_s=0.05)
        res["ready_s"] = proc.startup_s
        progress(f"vlmserve: ready after {proc.startup_s:.1f} s")
        srv = Server("vlmserve", proc.base_url, _model_id(proc.base_url), {"return_token_ids": True})
        res |= measure("vlmserve", proc.proc.pid, srv, model_dir, args, vision=True)
        with contextlib.suppress(Exception):
            metrics = asyncio.run(harness.scrape(proc.base_url))
            res["kv_cache_bytes"] = metrics.get("vlmserve_kv_cache_bytes")
    except Exception as exc:  # a failed start or a broken run is a result, and the peer still runs
        res["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"vlmserve: {res['error'][:500]}")
    finally:
        proc.stop()
    with contextlib.suppress(OSError):
        res["startup"] = parse_startup(log_path.read_text(errors="replace"))
    return res


def run_llamacpp(model_dir: Path, args, stamp: str) -> dict:
    res: dict = {}
    try:
        progress("llama.cpp: build (cached after the first time) and conversion to a bf16 GGUF")
        bin_dir = llamacpp.ensure_built()
        gguf, mmproj = llamacpp.convert(model_dir, outtype="bf16")
    except (llamacpp.PeerUnavailable, OSError) as exc:
        progress(f"llama.cpp skipped: {exc}")
        return {"skipped": str(exc)}
    res |= {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "mmproj": str(mmproj) if mmproj else None}
    if mmproj is None:
        res["vision_note"] = "no vision projector converted for this checkpoint"
    from preprocess import PreprocessConfig

    pp = PreprocessConfig.from_checkpoint(model_dir)
    img_tok = image_tokens(model_dir, IMAGE_SIZES[: args.images])
    slots = max([*args.streams, args.images, 1])
    # NOTE: llama.cpp splits -c evenly over the slots; each must hold the longest request it may get.
    per_slot = max(args.prefill_tokens + args.tokens, max(img_tok) + args.image_tokens, 512) + 256
    log_path = args.log_dir / f"{args.label}-{stamp}-llama-server.log"
    srv_proc = llamacpp.LlamaServer(
        gguf,
        mmproj,
        ctx=slots * per_slot,
        slots=slots,
        log_path=log_path,
        # vlmserve's budget: the checkpoint's min/max pixels in visual tokens (llama.cpp's own default differs)
        image_min_tokens=pp.min_pixels // pp.factor**2 if mmproj else None,
        image_max_tokens=pp.max_pixels // pp.factor**2 if mmproj else None,
        extra=args.llamacpp_arg,
        bin_dir=bin_dir,
        ready_timeout_s=args.ready_timeout,
    )
    res |= {"argv": srv_proc.argv, "log": str(log_path)}
    progress(f"llama.cpp: starting (log {log_path})")
    try:
        srv_proc.start()
        res["ready_s"] = srv_proc.startup_s
        srv = Server(
            "llama.cpp", srv_proc.base_url, _model_id(srv_proc.base_url), {"timings_per_token": True}
        )
        res |= measure("llama.cpp", srv_proc.pid, srv, model_dir, args, vision=mmproj is not None)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"llama.cpp: {res['error'][:500]}")
    finally:
        srv_proc.stop()
    with contextlib.suppress(OSError):
        text = log_path.read_text(errors="replace")
        res["kv_cache_bytes"] = llamacpp_kv_bytes(text)
        res["startup"] = parse_startup(text)
    return res


# ---------------------------------------------------------------- tower and prefill in-process


def decoder_flops(cfg, tokens: int) -> dict:
    """FLOPs of a causal prefill of ``tokens`` through the decoder: its linear layers, the attention core
    (q·kᵀ and P·v over the causal half) and the output projection of the last row only."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = (
        h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * cfg.intermediate_size
    )
    linear = 2 * tokens * cfg.num_hidden_layers * per_layer + 2 * h * cfg.vocab_size
    attention = 2 * tokens * (tokens + 1) * d * cfg.num_attention_heads * cfg.num_hidden_layers
    return {"linear": float(linear), "attention": float(attention)}


def _rounds(fn, repeat: int, flops: float, dtype, shape: tuple[int, int, int]) -> dict:
    """``fn`` timed ``repeat`` times after a warm-up, each round right after a measurement of the matmul rate
    (best of 3): each round's GFLOP/s ÷ that rate, and their median. NOTE: on this project's VMs the matmul rate
    moved 1,145 → 1,954 GFLOP/s between the start and the end of one run (2026-12-07, a Xeon with AMX), so a
    ratio against a rate measured minutes away says more about the neighbours than about the code."""
    fn()
    seconds, rates = [], []
    for _ in range(repeat):
        rates.append(matmul_gflops(str(dtype).removeprefix("torch."), shape, 3))
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    per_round = [flops / s / 1e9 / r for s, r in zip(seconds, rates)]
    return {
        "seconds": min(seconds),
        "round_seconds": seconds,
        "round_matmul_gflops": rates,
        "vs_matmul_rounds": per_round,
        "vs_matmul": statistics.median(per_round),
    }


def tower_rate(model_dir: Path, dtype, side: int, repeat: int) -> dict:
    """One ``side``² image through the tower, built as the engine builds it (linear layers packed)."""
    import torch

    from benchmarks.encoder_throughput import image_grids, work
    from encoder.models import build_vision_tower
    from runtime.linear import pack_linears

    raw = json.loads((model_dir / "config.json").read_text())
    tower = build_vision_tower(raw, model_dir, dtype=dtype, device="cpu")
    pack_linears(tower, pool="vision")
    grids = image_grids(model_dir, [(side, side)])
    flops = work(tower.cfg, grids)
    pixels, grid = torch.randn(flops["patches"], tower.cfg.patch_dim), torch.tensor(grids)
    total = flops["linear"] + flops["attention"]
    with torch.no_grad():
        timed = _rounds(lambda: tower(pixels, grid), repeat, total, dtype, matmul_shape(model_dir))
    seconds = timed["seconds"]
    return {
        "image": [side, side],
        "patches": flops["patches"],
        "flops": total,
        "gflops": total / seconds / 1e9,
        "patches_per_s": flops["patches"] / seconds,
        **timed,
    }


def prefill_rate(model_dir: Path, dtype, tokens: int, repeat: int) -> dict:
    """A ``tokens`` text prefill through the decoder as the engine builds it (packed linears, its attention
    backend), into throwaway paged caches, as the engine's start-up warm-up step runs it."""
    import torch

    from lm_engine.attention import AttentionMetadata, get_backend
    from lm_engine.models.qwen2_vl import use_step_kernels
    from lm_engine.models.registry import build_decoder, load_model_config
    from runtime import cpu_kernel
    from runtime.linear import pack_linears
    from runtime.weights import uninitialized

    cfg = load_model_config(model_dir)
    with torch.device("cpu"), uninitialized(dtype):
        model = build_decoder(cfg)
    model.to(dtype)
    model.load_weights(model_dir)
    model.eval()
    pack_linears(model, pool="prefill")
    if (
        dtype == torch.bfloat16
    ):  # the norm, rotary and silu · up kernels, as the engine's model runner hands them
        use_step_kernels(model, cpu_kernel.load())
    backend = get_backend("cpu", "auto")
    block = 16
    n_blocks = (tokens + block - 1) // block
    shape = (n_blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    backend.warmup(*caches[0], cfg.num_attention_heads, tokens)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_spans=[(0, tokens, tokens)],
        prefill_block_tables=[torch.arange(n_blocks)],
    )
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens).expand(3, -1)

    def step():
        hidden = model(ids, pos, caches, meta, backend)
        model.compute_logits(hidden[-1:])

    flops = decoder_flops(cfg, tokens)
    total = flops["linear"] + flops["attention"]
    with torch.no_grad():
        timed = _rounds(step, repeat, total, dtype, matmul_shape(model_dir))
    seconds = timed["seconds"]
    return {
        "tokens": tokens,
        **timed,
        "flops": total,
        "gflops": total / seconds / 1e9,
        "tokens_per_s": tokens / seconds,
        "attention_share_of_flops": flops["attention"] / total,
    }


def measure_tower(model_dir: Path, args, flags: Sequence[str], weights: dict) -> dict:
    import torch

    from runtime.memory import bound_native_caches, huge_page_tensors

    bound_native_caches()  # the process settings `vlmserve serve` runs its tower and prefill under
    huge_page_tensors()
    out: dict = {}
    side = 448 if args.quick else 1024
    repeat = 1 if args.quick else 3
    for name in ("bfloat16", "float32"):
        row: dict = {}
        out[name] = row
        if name == "bfloat16" and not bf16_fast(flags):
            row["skipped"] = "no AVX512-BF16 or AMX: bf16 would be emulated (the engine picks float32 here)"
            continue
        dtype = getattr(torch, name)
        progress(f"tower: {side}² image through the vision tower in {name}")
        try:
            row["tower"] = tower_rate(model_dir, dtype, side, repeat)
        except Exception as exc:
            row["tower"] = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()  # the tower's weights go before the decoder's come
        # NOTE: pack_linears holds every plain weight until all are packed: a peak of twice the decoder.
        need = 2 * weights["decoder_params"] * dtype.itemsize
        avail = meminfo().get("MemAvailable", 0)
        if need > 0.8 * avail:
            row["prefill"] = {"skipped": f"needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"}
            continue
        progress(f"tower: {args.prefill_tokens}-token prefill through the decoder in {name}")
        try:
            row["prefill"] = prefill_rate(model_dir, dtype, args.prefill_tokens, repeat)
        except Exception as exc:
            row["prefill"] = {"error": f"{type(exc).__name__}: {exc}"}
        gc.collect()
    return out


# ---------------------------------------------------------------- the report


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def best_matmul(result: dict, dtype: str) -> float | None:
    rates = [_get(result, "machine", when, "matmul_gflops", dtype) for when in ("before", "after")]
    rates = [r for r in rates if r]
    return max(rates) if rates else None


def ratios(result: dict) -> dict:
    """The headline ratios: each against the machine's limit measured in the run and against the peer."""
    vl, peer = result.get("vlmserve") or {}, result.get("llamacpp") or {}
    floor = _get(result, "floor", "ms_best")
    out = {
        "decode_1_vs_floor": harness.ratio(_get(vl, "decode", "1", "ms_per_token_mean"), floor),
        "peer_decode_1_vs_floor": harness.ratio(_get(peer, "decode", "1", "ms_per_token_mean"), floor),
    }
    for k in _get(vl, "decode") or {}:
        out[f"decode_{k}_vs_peer"] = harness.ratio(
            _get(vl, "decode", k, "ms_per_token_mean"), _get(peer, "decode", k, "ms_per_token_mean")
        )
    out["prefill_tokens_per_s_vs_peer"] = harness.ratio(
        _get(vl, "prefill", "tokens_per_s"), _get(peer, "prefill", "tokens_per_s")
    )
    out["images_req_per_s_vs_peer"] = harness.ratio(
        _get(vl, "images", "req_per_s"), _get(peer, "images", "req_per_s")
    )
    out["images_ttft_p50_vs_peer"] = harness.ratio(
        _get(vl, "images", "ttft_p50_s"), _get(peer, "images", "ttft_p50_s")
    )
    out["ready_vs_peer"] = harness.ratio(vl.get("ready_s"), peer.get("ready_s"))
    weights, kv = _get(result, "weights", "total_bytes"), vl.get("kv_cache_bytes")
    rss = max(_get(vl, "rss_after_load", "bytes") or 0, vl.get("rss_peak_bytes") or 0) or None
    if weights and rss:
        bound = weights + (kv or 0) + RSS_BOUND_SLACK
        out["rss_bound_bytes"] = bound
        out["rss_vs_bound"] = rss / bound
    for dtype, row in (result.get("tower") or {}).items():
        mm = best_matmul(result, dtype)
        for part in ("tower", "prefill"):
            adjacent = _get(row, part, "vs_matmul")  # each round against the rate measured just before it
            out[f"{part}_{dtype}_vs_matmul"] = (
                adjacent if adjacent is not None else harness.ratio(_get(row, part, "gflops"), mm)
            )
    return out


def summary_table(result: dict) -> str:
    """The run's summary as printed and written beside its results.json: the machine and the weights, the table of
    vlmserve against llama.cpp, then the run's notes (start-up, errors, the in-process tower and prefill)."""
    return "\n".join([*_machine_lines(result), *_comparison_table(result), *_run_notes(result)])


def _machine_lines(result: dict) -> list[str]:
    m = result.get("machine") or {}
    lines = [
        f"real_size: {result['label']}  ({result['model']})",
        f"CPU {m.get('cpu_model')}  flags {' '.join(m.get('flags') or []) or '-'}",
    ]
    for when in ("before", "after"):
        row = m.get(when)
        if row:
            mm = row["matmul_gflops"]
            lines.append(
                f"  {when:6}: read {harness.fmt(row['read_gbs'], '.1f')} GB/s, matmul {'×'.join(map(str, row['matmul_shape']))}"
                f" bf16 {harness.fmt(mm.get('bfloat16'), '.0f')} / fp32 {harness.fmt(mm.get('float32'), '.0f')} GFLOP/s"
            )
    w, fl = result.get("weights") or {}, result.get("floor") or {}
    if w:
        lines.append(
            f"weights {w['total_bytes'] / 1e9:.2f} GB (decoder {w['decoder_bytes'] / 1e9:.2f}, tower "
            f"{w['vision_bytes'] / 1e9:.2f}, {'tied' if w['tied'] else 'untied'} head); a decode step reads "
            f"{w['floor_bytes'] / 1e9:.2f} GB: floor {harness.fmt(fl.get('ms_best'), '.1f')} ms/token "
            f"(before {harness.fmt(fl.get('ms_before'), '.1f')}, after {harness.fmt(fl.get('ms_after'), '.1f')})"
        )
    return lines


def _comparison_table(result: dict) -> list[str]:
    vl, peer = result.get("vlmserve") or {}, result.get("llamacpp") or {}
    r = result["ratios"]
    peer_name = (
        "llama.cpp" if peer and "skipped" not in peer else "llama.cpp: " + ("skipped" if peer else "none")
    )
    head = f"| {'':34} | {'vlmserve':>14} | {peer_name[:40]:>14} | {'ratio':>8} |"
    lines = ["", head, "|" + "-" * (len(head) - 2) + "|"]

    def row(label: str, a, b, ratio=None, spec: str = ".1f") -> None:
        lines.append(
            f"| {label:34} | {harness.fmt(a, spec):>14} | {harness.fmt(b, spec):>14} | {harness.fmt(ratio, '.2f'):>8} |"
        )

    row("ready (spawn → /health 200), s", vl.get("ready_s"), peer.get("ready_s"), r.get("ready_vs_peer"))
    row(
        "others' CPU share meanwhile, %",
        (_get(vl, "cpu", "others_share") or 0) * 100 if vl.get("cpu") else None,
        (_get(peer, "cpu", "others_share") or 0) * 100 if peer.get("cpu") else None,
        None,
        ".0f",
    )
    for k in sorted((vl.get("decode") or {}), key=int):
        a, b = _get(vl, "decode", k, "ms_per_token_mean"), _get(peer, "decode", k, "ms_per_token_mean")
        row(f"decode {k} stream(s), ms/token", a, b, r.get(f"decode_{k}_vs_peer"))
        for label, key in (
            ("  gap p50", "ms_per_token_p50"),
            ("  gap p90", "ms_per_token_p90"),
            ("  e2e ÷ tokens (TTFT in)", "ms_per_token_e2e"),
            ("  aggregate tokens/s", "aggregate_tokens_per_s"),
        ):
            row(label, _get(vl, "decode", k, key), _get(peer, "decode", k, key))
    if "1" in (vl.get("decode") or {}):
        row(
            "decode 1 stream ÷ floor",
            r.get("decode_1_vs_floor"),
            r.get("peer_decode_1_vs_floor"),
            None,
            ".2f",
        )
    if vl.get("prefill") or peer.get("prefill"):
        row(
            f"prefill {_get(vl, 'prefill', 'prompt_tokens') or '?'} tokens, tokens/s",
            _get(vl, "prefill", "tokens_per_s"),
            _get(peer, "prefill", "tokens_per_s"),
            r.get("prefill_tokens_per_s_vs_peer"),
        )
        row("  TTFT, s", _get(vl, "prefill", "ttft_s"), _get(peer, "prefill", "ttft_s"), None, ".2f")
    if vl.get("images") or peer.get("images"):
        n = _get(vl, "images", "requests") or _get(peer, "images", "requests")
        row(
            f"{n} image requests at once, req/s",
            _get(vl, "images", "req_per_s"),
            _get(peer, "images", "req_per_s"),
            r.get("images_req_per_s_vs_peer"),
            ".3f",
        )
        row(
            "  TTFT p50, s",
            _get(vl, "images", "ttft_p50_s"),
            _get(peer, "images", "ttft_p50_s"),
            r.get("images_ttft_p50_vs_peer"),
            ".2f",
        )
        toks = [_get(x, "images", "prompt_tokens") for x in (vl, peer)]
        means = [float(np.mean([t for t in ts if t])) if ts and any(ts) else None for ts in toks]
        row("  prompt tokens per request, mean", *means, None, ".0f")
    for label, key in (
        ("RSS after warm-up, GiB", "rss_after_warmup"),
        ("RSS after the load, GiB", "rss_after_load"),
    ):
        row(label, *(_get(x, key, "bytes") and x[key]["bytes"] / GIB for x in (vl, peer)), None, ".2f")
    for label, key in (("RSS peak (sampled), GiB", "rss_peak_bytes"), ("KV pool, GiB", "kv_cache_bytes")):
        row(label, *((x.get(key) or 0) / GIB or None for x in (vl, peer)), None, ".2f")
    return lines


def _run_notes(result: dict) -> list[str]:
    vl, peer = result.get("vlmserve") or {}, result.get("llamacpp") or {}
    r = result["ratios"]
    st = vl.get("startup")
    lines = []
    if r.get("rss_bound_bytes"):
        lines.append(
            f"vlmserve RSS (peak of after-load and sampled) ÷ (weights + KV pool + 1.5 GB = "
            f"{r['rss_bound_bytes'] / GIB:.2f} GiB): {r['rss_vs_bound']:.2f}"
        )
    if st:
        lines.append(
            f"vlmserve start-up {st['total_s']:.1f} s: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in st["phases"].items())
        )
    else:
        lines.append("vlmserve start-up phases: no 'start-up N s: ...' line in its log")
    for name, x in (("vlmserve", vl), ("llama.cpp", peer)):
        if x.get("error"):
            lines.append(f"{name} error: {x['error'][:300]}")
        if x.get("skipped"):
            lines.append(f"{name} skipped: {x['skipped'][:300]}")
    for dtype, t in (result.get("tower") or {}).items():
        if t.get("skipped"):
            lines.append(f"in-process {dtype}: skipped ({t['skipped']})")
            continue
        mm = best_matmul(result, dtype)
        for part, what in (("tower", "tower"), ("prefill", "decoder prefill")):
            x = t.get(part) or {}
            if "gflops" in x:
                size = f"{x['image'][0]}² image" if part == "tower" else f"{x['tokens']} tokens"
                rate = (
                    f"the matmul rate measured before each round ({', '.join(f'{g:.0f}' for g in x['round_matmul_gflops'])}; median of the rounds)"
                    if x.get("round_matmul_gflops")
                    else f"the matmul rate ({harness.fmt(mm, '.0f')})"
                )
                lines.append(
                    f"in-process {dtype} {what}, {size}: {x['seconds']:.2f} s, {x['gflops']:.0f} GFLOP/s = "
                    f"{harness.fmt(r.get(f'{part}_{dtype}_vs_matmul'), '.0%')} of {rate}"
                )
            elif x:
                lines.append(f"in-process {dtype} {what}: {x.get('skipped') or x.get('error')}")
    return lines


# ---------------------------------------------------------------- main


def split_events(result: dict) -> dict:
    """Pops each decode row's per-stream token timings out of ``result`` and returns them: they are most of
    its bytes, so they go beside the logs (benchmarks/out/) and the summary stays small."""
    out: dict = {}
    for server in ("vlmserve", "llamacpp"):
        for streams, row in ((result.get(server) or {}).get("decode") or {}).items():
            if isinstance(row, dict) and "events" in row:
                out.setdefault(server, {})[streams] = row.pop("events")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model.resolve()
    if not (model_dir / "config.json").is_file():
        print(f"--model {model_dir}: no config.json there", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    weights = weight_bytes(model_dir)
    result: dict = {
        "label": args.label,
        "model": str(model_dir),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {
            k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
        },
        "machine": {
            **cpu,
            "l3_bytes": l3_bytes(),
            **{k.lower(): v for k, v in meminfo().items()},
            "host": harness.machine(),
        },
        "weights": weights,
    }
    progress(
        f"{model_dir.name}: {weights['total_bytes'] / 1e9:.2f} GB of weights, a decode step reads "
        f"{weights['floor_bytes'] / 1e9:.2f} GB; CPU {cpu['cpu_model']} ({' '.join(cpu['flags'])})"
    )
    if "machine" not in args.skip:
        progress("machine: read bandwidth and matmul rates (before the servers)")
        result["machine"]["before"] = measure_machine(model_dir, cpu["flags"], args.quick)
        progress(f"machine: read {result['machine']['before']['read_gbs']:.1f} GB/s")
    result["vlmserve"] = run_vlmserve(model_dir, args, stamp)
    if args.peer == "llamacpp":
        result["llamacpp"] = run_llamacpp(model_dir, args, stamp)
    if "tower" not in args.skip:
        result["tower"] = measure_tower(model_dir, args, cpu["flags"], weights)
    if "machine" not in args.skip:
        progress("machine: read bandwidth and matmul rates (after)")
        result["machine"]["after"] = measure_machine(model_dir, cpu["flags"], args.quick)
        rates = [result["machine"][w]["read_gbs"] for w in ("before", "after")]
        result["floor"] = {
            "bytes": weights["floor_bytes"],
            "ms_before": floor_ms(weights["floor_bytes"], rates[0]),
            "ms_after": floor_ms(weights["floor_bytes"], rates[1]),
            "ms_best": floor_ms(weights["floor_bytes"], max(rates)),  # the faster read: the stricter floor
        }
    result["ratios"] = ratios(result)
    events = split_events(result)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    (args.log_dir / f"{args.label}-{stamp}-events.json").write_text(json.dumps(events) + "\n")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"{args.label}-{stamp}.json"
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(summary_table(result))
    print(f"\nresult: {out}")
    return 0 if not (result["vlmserve"].get("error")) else 1


if __name__ == "__main__":
    sys.exit(main())
