"""Memory soak: does a vlmserve server's memory plateau under a long run of one kind of traffic?

Starts ``vlmserve serve`` on 127.0.0.1 (a free port; the generated preset checkpoint under
``benchmarks/out/``, ``tiny`` by default), sends ``-n`` chat requests (default 3,000) of one ``--mix`` from
``--concurrency`` clients (``max_tokens`` 4), and every ``--sample-every`` finished requests reads every
process of the server's process group (the server, the preprocess forkserver and its workers): RSS and PSS
from ``/proc/PID/smaps_rollup``, open file descriptors; and from ``/metrics`` what the server holds by
design (KV pool, embedding cache, prefix-cache index). Prints the table and, over the last half of the run,
the slope of the total PSS (MB per 1,000 requests, least squares) and its growth (%); writes the samples
as a CSV under ``benchmarks/results/soak/`` and their plot (PNG) under ``benchmarks/out/soak/``.

    .venv/bin/python benchmarks/soak.py --mix distinct-random          # distinct JPEGs, 64-700 px a side
    .venv/bin/python benchmarks/soak.py --mix text -n 1000 --max-seconds 900
    .venv/bin/python benchmarks/soak.py --mix fixed --env MALLOC_ARENA_MAX=2 --label arena2
    .venv/bin/python benchmarks/soak.py --mix pages --preset small -- --embedding-cache-mb 64
    # the plateau checks: random-size images once the embedding cache is full, and 3,000 requests on the
    # small preset in bf16 (oneDNN's shape caches); add --max-seconds if an hour cannot finish them
    .venv/bin/python benchmarks/soak.py --mix distinct-random --fill-embedding-cache -- --embedding-cache-mb 64
    .venv/bin/python benchmarks/soak.py --preset small --mix distinct-random -n 3000 -- --dtype bfloat16
    .venv/bin/python benchmarks/soak.py --preset small --mix text -n 3000 -- --dtype bfloat16

Mixes: ``distinct-random`` (a new JPEG per request, each side uniform in 64-700 px), ``fixed`` (a new
320x240 JPEG per request), ``text`` (5-180 words, no image), ``pages`` (16 page images asked about in turn:
embedding-cache and prefix-cache hits). Flags after ``--`` go to ``vlmserve serve``. Loopback only; the run
stops at ``-n`` requests or ``--max-seconds``, whichever comes first, and the server is always stopped.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import base64
import contextlib
import csv
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import harness, load

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results" / "soak"
_JSON = {"Content-Type": "application/json"}
MIXES = ("distinct-random", "fixed", "text", "pages")
# What the server holds by design, read from /metrics at each sample (name prefix → CSV column).
HELD_METRICS = {
    "vlmserve_kv_cache_bytes": "kv_mb",
    'vlmserve_embedding_cache_bytes{tier="memory"}': "emb_cache_mb",
    "vlmserve_prefix_cache_index_entries": "prefix_entries",
    "vlmserve_requests_tracked": "tracked",
    "process_resident_memory_bytes": "metrics_rss_mb",
}


# ---------------------------------------------------------------- traffic


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(load.FILLER) for _ in range(n))


def _image_part(data: bytes) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _page(index: int) -> bytes:
    return load.synth_image(640, 480, "jpeg", seed=10_000 + index)


def fill_body(i: int, seed: int) -> bytes:
    """A distinct 1024x1024 image (the largest embedding the tiny and small presets make at full budget)."""
    image = load.synth_image(1024, 1024, "jpeg", seed=seed * 1_000_003 + 2 * 10**8 + i)
    part = _image_part(image)
    part["image_url"]["detail"] = "high"  # full resolution whatever the load: the largest embedding
    content = [part, {"type": "text", "text": "fill"}]
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()


def make_body(mix: str, i: int, seed: int, max_tokens: int) -> bytes:
    """Request ``i`` of the mix (deterministic in ``seed``); images are made here, off the event loop."""
    rng = random.Random(seed * 1_000_003 + i)
    question = rng.choice(load.PROMPTS)
    if mix == "text":
        content: str | list = _words(rng, rng.randint(5, 180))
    elif mix == "pages":
        content = [_image_part(_page(i % 16)), {"type": "text", "text": question}]
    else:
        w, h = (rng.randint(64, 700), rng.randint(64, 700)) if mix == "distinct-random" else (320, 240)
        image = load.synth_image(w, h, "jpeg", seed=seed * 1_000_003 + i)
        content = [_image_part(image), {"type": "text", "text": question}]
    body = {
        "model": None,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


# ---------------------------------------------------------------- sampling /proc


def _stat(pid: int) -> tuple[int, int]:
    """(ppid, pgrp) from /proc/PID/stat (the fields after the command name, which may hold spaces)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[2])


def group_pids(pgid: int) -> dict[int, int]:
    """pid → ppid of every live process in process group ``pgid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid, pgrp = _stat(int(entry))
                if pgrp == pgid:
                    out[int(entry)] = ppid
    return out


def smaps_rollup(pid: int) -> dict[str, int]:
    """Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem of ``pid`` in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem"):
            out[name] = int(rest.split()[0])
    return out


def mapping_pss(pid: int) -> dict[str, int]:
    """kB of PSS per mapping name (a file, [heap], [anon], /dev/shm/...) from /proc/PID/smaps."""
    out: dict[str, int] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if (
            head and "-" in head[0] and ":" not in head[0]
        ):  # a mapping's header: addr perms offset dev inode [path]
            name = head[5] if len(head) > 5 else "[anon]"
        elif head and head[0] == "Pss:":
            out[name] = out.get(name, 0) + int(head[1])
    return out


def mapping_growth(before: dict[str, int], after: dict[str, int], top: int = 8) -> list[str]:
    diffs = sorted(
        ((after.get(k, 0) - before.get(k, 0), k) for k in before.keys() | after.keys()), reverse=True
    )
    return [f"  {d / 1024:+8.1f} MB  {name}" for d, name in diffs[:top] if d]


def _role(pid: int, ppid: int, root: int) -> str:
    if pid == root:
        return "server"
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    if b"resource_tracker" in cmd:
        return "resource_tracker"
    if b"api.cli encoder" in cmd:
        return "encoder_pool"  # serve --encoder-workers: the pool's own process
    if b"spawn_main" in cmd:
        return "encoder_worker"  # a pool's vision-tower process
    return "forkserver" if ppid == root else "preprocess_worker"


@dataclass(slots=True)
class ProcSample:
    pid: int
    role: str
    rss_kb: int
    pss_kb: int
    pss_anon_kb: int
    pss_shmem_kb: int
    fds: int


def sample_group(root: int) -> list[ProcSample]:
    """Every process of ``root``'s process group (it leads one: started in a new session)."""
    out = []
    for pid, ppid in sorted(group_pids(root).items()):
        with contextlib.suppress(OSError):  # it exited meanwhile
            m = smaps_rollup(pid)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
            role = _role(pid, ppid, root)
            out.append(
                ProcSample(pid, role, m["Rss"], m["Pss"], m.get("Pss_Anon", 0), m.get("Pss_Shmem", 0), fds)
            )
    return out


async def held_by_design(client: httpx.AsyncClient) -> dict[str, float]:
    """The /metrics gauges of HELD_METRICS (absent ones are left out); bytes as MB."""
    with contextlib.suppress(httpx.HTTPError):
        metrics = harness.parse_prometheus((await client.get("/metrics")).text)
        out = {}
        for name, column in HELD_METRICS.items():
            if name in metrics:
                value = metrics[name]
                out[column] = value / 2**20 if column.endswith("_mb") else value
        return out
    return {}


@dataclass(slots=True)
class Sample:
    requests: int
    seconds: float
    procs: list[ProcSample]
    held: dict[str, float] = field(default_factory=dict)

    def total(self, attr: str = "pss_kb") -> float:
        return sum(getattr(p, attr) for p in self.procs) / 1024

    def server(self, attr: str = "pss_kb") -> float:
        return sum(getattr(p, attr) for p in self.procs if p.role == "server") / 1024


# ---------------------------------------------------------------- the run


@dataclass(slots=True)
class Run:
    n: int
    started: float = field(default_factory=time.monotonic)
    next_index: int = 0
    done: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    filled: int = 0  # requests sent to fill the embedding cache before the run
    retries: int = 0  # 503s answered by sending the request again
    maps_before: dict[str, int] = field(default_factory=dict)  # the server's PSS per mapping, kB
    maps_after: dict[str, int] = field(default_factory=dict)

    def take(self) -> int | None:
        if self.next_index >= self.n:
            return None
        self.next_index += 1
        return self.next_index - 1


async def _one(client: httpx.AsyncClient, body: bytes, run: Run) -> None:
    """One request; a 503 (admission control) is sent again after its Retry-After (at most 2 s), as
    OpenAI clients do, so every request of the mix reaches the engine."""
    for _ in range(60):
        try:
            resp = await client.post("/v1/chat/completions", content=body, headers=_JSON)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
            break
        status = str(resp.status_code)
        if resp.status_code != 503:
            break
        run.retries += 1
        await asyncio.sleep(min(2.0, float(resp.headers.get("retry-after", 1))))
    if status != "200" and len(run.errors) < 5:
        run.errors.append(f"{status}: {resp.text[:200] if status.isdigit() else ''}")
    run.statuses[status] = run.statuses.get(status, 0) + 1


async def _sample(client: httpx.AsyncClient, run: Run, root: int) -> None:
    s = Sample(run.done, time.monotonic() - run.started, sample_group(root), await held_by_design(client))
    run.samples.append(s)
    print(
        f"  {s.requests:6d} requests {s.seconds:7.0f} s  PSS {s.total():8.1f} MB (server {s.server():8.1f})  "
        f"fds {sum(p.fds for p in s.procs)}",
        file=sys.stderr,
        flush=True,
    )


async def _client_loop(client, run: Run, args, root: int, deadline: float) -> None:
    while time.monotonic() < deadline and (i := run.take()) is not None:
        body = await asyncio.to_thread(make_body, args.mix, i, args.seed, args.max_tokens)
        await _one(client, body, run)
        run.done += 1
        if run.done % args.sample_every == 0:
            await _sample(client, run, root)


async def _evictions(client: httpx.AsyncClient) -> float:
    metrics = harness.parse_prometheus((await client.get("/metrics")).text)
    return metrics.get('vlmserve_embedding_cache_evictions_total{tier="memory"}', 0.0)


async def fill_embedding_cache(client: httpx.AsyncClient, args: argparse.Namespace) -> int:
    """Send distinct large images until the in-process embedding cache has evicted (so it is full);
    returns how many it took. Bounded by ``--fill-max-requests``."""
    sent = 0
    while sent < args.fill_max_requests and await _evictions(client) == 0:
        batch = range(sent, sent + args.concurrency)
        bodies = await asyncio.gather(*(asyncio.to_thread(fill_body, i, args.seed) for i in batch))
        await asyncio.gather(*(_one(client, b, Run(0)) for b in bodies))
        sent += len(batch)
    full = await _evictions(client) > 0
    print(f"  embedding cache {'full' if full else 'NOT full'} after {sent} fill requests", file=sys.stderr)
    return sent


async def soak(base_url: str, root: int, args: argparse.Namespace) -> Run:
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        for i in range(args.warmup):  # the first requests build caches, kernels and threads: not a leak
            await _one(client, make_body(args.mix, 10**7 + i, args.seed, args.max_tokens), Run(0))
        filled = await fill_embedding_cache(client, args) if args.fill_embedding_cache else 0
        run = Run(args.n, filled=filled)
        await _sample(client, run, root)
        run.maps_before = mapping_pss(root)
        deadline = run.started + args.max_seconds
        loops = [_client_loop(client, run, args, root, deadline) for _ in range(args.concurrency)]
        await asyncio.gather(*loops)
        if run.done % args.sample_every:
            await _sample(client, run, root)
        run.maps_after = mapping_pss(root)
    return run


# ---------------------------------------------------------------- report


def slope_per_1000(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys against xs, per 1,000 units of x."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


@dataclass(slots=True)
class Growth:
    start: float  # MB at the first sample after `sample_every` requests (the run's own start-up excluded)
    middle: float  # at the sample nearest half the requests
    end: float
    slope: float | None  # MB per 1,000 requests over the last half
    percent: float  # (end - middle) / middle


def growth(samples: list[Sample], value) -> Growth | None:
    if len(samples) < 3:
        return None
    last = samples[-1].requests
    mid = min(samples, key=lambda s: abs(s.requests - last / 2))
    tail = [s for s in samples if s.requests >= mid.requests]
    slope = slope_per_1000([s.requests for s in tail], [value(s) for s in tail])
    start = samples[1] if len(samples) > 1 else samples[0]
    m, e = value(mid), value(samples[-1])
    return Growth(value(start), m, e, slope, 100 * (e - m) / m if m else 0.0)


def _col(s: Sample, name: str, spec: str = ".0f") -> str:
    v = s.held.get(name)
    return "-" if v is None else format(v, spec)


def table(samples: list[Sample]) -> str:
    cols = ["requests", "s", "PSS total MB", "server PSS", "server RSS", "others PSS", "fds", "KV MB"]
    cols += ["emb cache MB", "prefix entries"]
    rows = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for s in samples:
        rows.append(
            f"| {s.requests} | {s.seconds:.0f} | {s.total():.1f} | {s.server():.1f} | {s.server('rss_kb'):.1f} "
            f"| {s.total() - s.server():.1f} | {sum(p.fds for p in s.procs)} | {_col(s, 'kv_mb')} "
            f"| {_col(s, 'emb_cache_mb', '.1f')} | {_col(s, 'prefix_entries')} |"
        )
    return "\n".join(rows)


def verdict(name: str, g: Growth | None, target_pct: float) -> str:
    if g is None:
        return f"{name}: too few samples for a slope"
    ok = "meets" if g.percent < target_pct else "MISSES"
    slope = "n/a" if g.slope is None else f"{g.slope:+.1f}"
    return (
        f"{name}: start {g.start:.1f} MB, middle {g.middle:.1f} MB, end {g.end:.1f} MB; last half: "
        f"{slope} MB per 1,000 requests, {g.percent:+.2f} % ({ok} the < {target_pct:g} % target)"
    )


def write_csv(samples: list[Sample], path: Path) -> None:
    held = sorted({k for s in samples for k in s.held})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "requests",
                "seconds",
                "pid",
                "role",
                "rss_kb",
                "pss_kb",
                "pss_anon_kb",
                "pss_shmem_kb",
                "fds",
                *held,
            ]
        )
        for s in samples:
            for p in s.procs:
                row = [s.requests, f"{s.seconds:.1f}", p.pid, p.role, p.rss_kb, p.pss_kb, p.pss_anon_kb]
                w.writerow([*row, p.pss_shmem_kb, p.fds, *(s.held.get(k, "") for k in held)])


def plot(samples: list[Sample], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    xs = [s.requests for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, [s.total() for s in samples], label="PSS, all processes", lw=2)
    ax.plot(xs, [s.server() for s in samples], label="PSS, server process")
    ax.plot(xs, [s.server("rss_kb") for s in samples], label="RSS, server process", ls="--")
    if any("emb_cache_mb" in s.held for s in samples):
        ax.plot(xs, [s.held.get("emb_cache_mb", 0) for s in samples], label="embedding cache (held)", ls=":")
    ax.set_xlabel("requests finished")
    ax.set_ylabel("MB")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def report(run: Run, args: argparse.Namespace, title: str) -> int:
    print(table(run.samples))
    elapsed = run.samples[-1].seconds if run.samples else 0.0
    print(
        f"\n{run.done} requests in {elapsed:.0f} s ({run.done / max(elapsed, 1e-9):.1f}/s); statuses {run.statuses}, {run.retries} 503s retried"
    )
    if run.filled:
        print(f"the embedding cache was filled first ({run.filled} requests of distinct 1024x1024 images)")
    for err in run.errors:
        print(f"  error: {err}")
    print(verdict("PSS, all processes", growth(run.samples, Sample.total), args.target_pct))
    print(verdict("PSS, server process", growth(run.samples, Sample.server), args.target_pct))
    print("the server's PSS by mapping, first sample to last (what grew):")
    print("\n".join(mapping_growth(run.maps_before, run.maps_after)) or "  (none grew)")
    if run.done < args.n:
        print(f"NOTE: stopped by --max-seconds after {run.done} of {args.n} requests")
    name = f"{args.mix}-{args.label or args.preset}"
    csv_path, png_path = RESULTS / f"{name}.csv", harness.bulk_dir(RESULTS) / f"{name}.png"
    for d in (csv_path.parent, png_path.parent):
        d.mkdir(parents=True, exist_ok=True)
    write_csv(run.samples, csv_path)
    plotted = plot(run.samples, png_path, title)
    print(f"wrote {csv_path}" + (f" and {png_path}" if plotted else ""))
    bad = sum(v for k, v in run.statuses.items() if k != "200")
    return 1 if bad > run.done // 100 else 0


# ---------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", default="distinct-random", choices=MIXES)
    p.add_argument("-n", type=int, default=3000, help="requests (default 3,000)")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--sample-every", type=int, default=100, help="requests between memory samples")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="stop sending after this long")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--warmup", type=int, default=3, help="unmeasured requests before the first sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="generated checkpoint")
    p.add_argument("--model", help="serve this checkpoint directory instead of a generated preset")
    p.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the server (e.g. MALLOC_ARENA_MAX=2)"
    )
    p.add_argument("--label", default=None, help="names the result files (default: the preset)")
    p.add_argument(
        "--fill-embedding-cache",
        action="store_true",
        help="before the run, send distinct 1024x1024 images until the embedding cache evicts (it is full)",
    )
    p.add_argument("--fill-max-requests", type=int, default=4000)
    p.add_argument("--target-pct", type=float, default=5.0, help="growth over the last half to beat")
    args = p.parse_args(argv)
    args.server_args = extra
    if args.n < 1 or args.concurrency < 1 or args.sample_every < 1:
        p.error("-n, --concurrency and --sample-every must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = harness.ensure_checkpoint(args.preset, 0, args.model)
    port = harness.free_port()
    env = dict(kv.split("=", 1) for kv in args.env)
    argv = harness.vlmserve_here_argv(model, port)
    argv += ["--served-model-name", "soak", *args.server_args]
    title = f"soak: {args.mix}, {args.concurrency} clients, max_tokens {args.max_tokens}, {model.name} {' '.join(args.env)} {' '.join(args.server_args)}"
    log = ROOT / "benchmarks" / "out" / f"soak-{args.mix}-{args.label or args.preset}.log"

    server = harness.ServerProcess("vlmserve", argv, port, log, env=env)

    def go() -> int:
        with server:  # NOTE: entered before start(): a server that never gets healthy is stopped too
            server.start()
            run = asyncio.run(soak(server.base_url, server.pgid, args))
        return report(run, args, title)

    return harness.run_main(go)


if __name__ == "__main__":
    sys.exit(main())
