"""Video under overload: the adaptive visual budget (its video ladder: frames first, then pixels) against a
fixed one, at twice the rate the server sustains at full budget.

Clips of mixed lengths (2-8 s) and resolutions (160x120 ... 320x240), a moving coloured square each, sent as
data: URLs with Poisson arrivals to servers without embedding or prefix cache (every request costs its whole
decode, encode and prefill). First a closed-loop
calibration at the fixed budget (``--concurrency`` in flight) measures the sustainable rate and the unloaded TTFT; the TTFT SLO is a multiple of
that TTFT (``--slo-factor``) unless given, and the server aims at it (``--ttft-slo-ms``). Then two runs on fresh
servers (cold caches), ``--visual-budget fixed`` and ``adaptive``, each offered ``--overload`` x the sustainable
rate for ``--duration`` seconds. Reported per run: goodput (requests/s answered within the TTFT SLO), p50/p90
TTFT, requests shed (503), other failures (must be 0), visual tokens per video (mean) and the ladder levels the
videos got (``usage.visual_levels``); and the goodput ratio adaptive/fixed.

    .venv/bin/python benchmarks/video_load.py                   # the tiny generated model, ~3-4 minutes
    .venv/bin/python benchmarks/video_load.py --duration 30     # shorter

Results go to ``benchmarks/results/video_load/``; server logs and clips to ``benchmarks/out/video_load/``.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.harness import (
    OUT_DIR,
    RESULTS_DIR,
    ServerProcess,
    ensure_checkpoint,
    free_port,
    machine,
    machine_line,
    run_main,
    vlmserve_here_argv,
)
from tests.support import make_clip

SIZES = [(160, 120), (256, 192), (320, 240)]
SECONDS = [2, 4, 8]
CLIP_FPS = 15


@dataclass(slots=True)
class Record:
    sent: float
    status: int = 0
    ttft: float | None = None
    end: float | None = None
    visual_tokens: int = 0
    levels: list[int] = field(default_factory=list)


def clips(n: int, seed: int) -> list[str]:
    """``n`` distinct clips as data: URLs (made once, kept under benchmarks/out/video_load/clips)."""
    folder = OUT_DIR / "video_load" / "clips"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        (w, h), secs = rng.choice(SIZES), rng.choice(SECONDS)
        path = folder / f"{i:03d}-{w}x{h}-{secs}s-seed{seed}.mp4"
        if not path.is_file():
            path.write_bytes(
                make_clip(frames=secs * CLIP_FPS, width=w, height=h, fps=CLIP_FPS, gop=15, seed=i)
            )
        out.append("data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode())
    return out


def body(url: str, max_tokens: int) -> dict:
    content = [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What moves, and where?"},
    ]
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one(client: httpx.AsyncClient, url: str, max_tokens: int, t0: float) -> Record:
    rec = Record(sent=time.perf_counter() - t0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body(url, max_tokens)) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if rec.ttft is None and chunk.get("choices"):
                    rec.ttft = time.perf_counter() - t0 - rec.sent
                if chunk.get("usage"):
                    rec.visual_tokens = sum(chunk["usage"]["visual_tokens"])
                    rec.levels = chunk["usage"]["visual_levels"]
    except httpx.HTTPError:
        rec.status = -1
    rec.end = time.perf_counter() - t0
    return rec


async def closed_loop(
    base_url: str, urls: list[str], max_tokens: int, concurrency: int
) -> tuple[float, float]:
    """Requests/s with ``concurrency`` in flight, and the median TTFT with one in flight (the first requests)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False) as client:
        t0 = time.perf_counter()
        alone = [await one(client, u, max_tokens, t0) for u in urls[:3]]
        queue = list(urls[3:])
        t1 = time.perf_counter()

        async def worker() -> int:
            done = 0
            while queue:
                await one(client, queue.pop(), max_tokens, t0)
                done += 1
            return done

        done = sum(await asyncio.gather(*(worker() for _ in range(concurrency))))
        rate = done / (time.perf_counter() - t1)
    return rate, statistics.median(r.ttft for r in alone if r.ttft is not None)


async def open_loop(base_url: str, urls: list[str], rate: float, duration: float, max_tokens: int, seed: int):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False) as client:
        t0 = time.perf_counter()
        tasks, at, i = [], 0.0, 0
        while at < duration:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(client, urls[i % len(urls)], max_tokens, t0)))
            i += 1
            at += rng.expovariate(rate)
        return await asyncio.gather(*tasks)


def summarize(records: list[Record], duration: float, slo_s: float) -> dict:
    ok = [r for r in records if r.status == 200 and r.ttft is not None]
    ttfts = sorted(r.ttft for r in ok)
    good = [r for r in ok if r.ttft <= slo_s]
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None  # noqa: E731
    return {
        "sent": len(records),
        "ok": len(ok),
        "shed_503": sum(r.status == 503 for r in records),
        "failed": sum(r.status not in (200, 503) for r in records),
        "goodput_rps": len(good) / duration,
        "ttft_p50_s": pct(0.5),
        "ttft_p90_s": pct(0.9),
        "visual_tokens_per_video": statistics.mean(r.visual_tokens for r in ok) if ok else None,
        "levels": dict(sorted(Counter(lv for r in ok for lv in r.levels).items())),
    }


def serve(model: Path, budget: str, slo_ms: float | None, log: Path) -> ServerProcess:
    port = free_port()
    # NOTE: no embedding or prefix cache: requests cycle through the clips, and a repeat served from a cache
    # would measure the caches, not the budget.
    extra = ["--served-model-name", "tiny", "--visual-budget", budget, "--limit-mm-per-prompt", "video=1",
             "--embedding-cache-mb", "0", "--no-enable-prefix-caching"]  # fmt: skip
    if slo_ms is not None:
        extra += ["--ttft-slo-ms", f"{slo_ms:.0f}"]
    return ServerProcess(f"vlmserve-{budget}", vlmserve_here_argv(model, port, extra), port, log)


def main_run(args: argparse.Namespace) -> int:
    model = ensure_checkpoint(args.preset, model=args.model)
    out = OUT_DIR / "video_load"
    urls = clips(args.clips, args.seed)
    with serve(model, "fixed", None, out / "calibrate.log") as server:
        server.start()
        rate, ttft = asyncio.run(
            closed_loop(server.base_url, urls[: args.calibrate + 3], args.max_tokens, args.concurrency)
        )
    slo_ms = args.slo_ttft_ms or args.slo_factor * ttft * 1000
    offered = args.overload * rate
    print(f"sustainable {rate:.2f} videos/s, unloaded TTFT {ttft:.2f} s; SLO {slo_ms:.0f} ms; offered "
          f"{offered:.2f}/s for {args.duration:.0f} s", file=sys.stderr)  # fmt: skip
    runs = {}
    for budget in ("fixed", "adaptive"):
        with serve(model, budget, slo_ms, out / f"{budget}.log") as server:
            server.start()
            records = asyncio.run(
                open_loop(server.base_url, urls, offered, args.duration, args.max_tokens, args.seed)
            )
        runs[budget] = summarize(records, args.duration, slo_ms / 1000)
    ratio = (
        runs["adaptive"]["goodput_rps"] / runs["fixed"]["goodput_rps"]
        if runs["fixed"]["goodput_rps"]
        else None
    )
    mach = machine()
    lines = [
        f"video_load: {model.name}, {args.clips} clips, offered {offered:.2f}/s ({args.overload}x {rate:.2f}/s) for "
        f"{args.duration:.0f} s, TTFT SLO {slo_ms:.0f} ms",
        machine_line(mach),
        f"{'budget':<9}{'sent':>6}{'ok':>5}{'503':>5}{'fail':>5}{'goodput/s':>11}{'p50 TTFT':>10}{'p90 TTFT':>10}"
        f"{'tokens/video':>14}  levels",
    ]
    for name, r in runs.items():
        p50 = f"{r['ttft_p50_s']:.2f}" if r["ttft_p50_s"] is not None else "-"
        p90 = f"{r['ttft_p90_s']:.2f}" if r["ttft_p90_s"] is not None else "-"
        tok = f"{r['visual_tokens_per_video']:.0f}" if r["visual_tokens_per_video"] is not None else "-"
        lines.append(
            f"{name:<9}{r['sent']:>6}{r['ok']:>5}{r['shed_503']:>5}{r['failed']:>5}{r['goodput_rps']:>11.3f}"
            f"{p50:>10}{p90:>10}{tok:>14}  {r['levels']}"
        )
    lines.append(
        f"goodput adaptive/fixed: {ratio:.2f}x" if ratio else "goodput adaptive/fixed: fixed had none"
    )
    print("\n".join(lines))
    results = Path(args.out_dir)
    results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record = {"args": vars(args), "machine": mach, "sustainable_rps": rate, "unloaded_ttft_s": ttft,
              "slo_ttft_ms": slo_ms, "offered_rps": offered, "runs": runs, "goodput_ratio": ratio}  # fmt: skip
    (results / f"{stamp}.json").write_text(json.dumps(record, indent=2, default=str))
    (results / f"{stamp}.txt").write_text("\n".join(lines) + "\n")
    return 0 if all(r["failed"] == 0 for r in runs.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="video_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the generated --preset)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--clips", type=int, default=48, help="distinct clips (requests cycle through them)")
    p.add_argument(
        "--calibrate", type=int, default=24, help="closed-loop requests that measure the sustainable rate"
    )
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight while calibrating")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--overload", type=float, default=2.0, help="offered rate / sustainable rate")
    p.add_argument(
        "--slo-ttft-ms", type=float, default=None, help="default: --slo-factor x the unloaded TTFT"
    )
    p.add_argument("--slo-factor", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(RESULTS_DIR / "video_load"))
    args = p.parse_args(argv)
    return run_main(lambda: main_run(args))


if __name__ == "__main__":
    sys.exit(main())
