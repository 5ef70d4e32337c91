"""vlmserve against ``transformers serve`` on the same checkpoint and the same trace, in one command.

Generates the ``small`` preset checkpoint once (under ``benchmarks/out/``), starts ``vlmserve serve`` on it
(127.0.0.1, a free port), drives it with a trace from ``benchmarks/load.py`` (default: 16 concurrent clients,
64 requests, the mixed resolution set 224² … 2048×1536, ``max_tokens`` 128 generated in full), checks
``/metrics`` for leaked KV blocks, stops it, then does the same with ``transformers serve`` (offline,
``HF_HUB_OFFLINE=1``) and prints both and the ratios: request throughput (target ≥ 4×) and p50 TTFT
(target ≤ 0.5×). ``--overload`` instead drives vlmserve alone, with admission control bounds, at a rate it
cannot sustain: every failure must be a fast 503 and no KV block may leak.

    .venv/bin/python benchmarks/serve_compare.py                    # the issue's run (minutes on 2 cores)
    .venv/bin/python benchmarks/serve_compare.py --quick            # 16 requests, 8 clients, 32 tokens
    .venv/bin/python benchmarks/serve_compare.py --quick --preset tiny   # smoke test of the harness
    .venv/bin/python benchmarks/serve_compare.py --overload         # admission control under overload

Results (JSON, a markdown table, load.py's CDF plots) go to ``benchmarks/results/serve_compare/`` (or
``.../overload/``); server logs to ``benchmarks/out/``. Servers run in their own process groups and are
stopped (SIGINT, then SIGTERM, then SIGKILL to the group) whatever happens, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import load  # noqa: E402

OUT_DIR = ROOT / "benchmarks" / "out"
RESULTS_DIR = ROOT / "benchmarks" / "results"
VENV_BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- checkpoint


def ensure_checkpoint(preset: str, seed: int = 0, model: str | None = None) -> Path:
    """``--model`` as given, else the generated preset under benchmarks/out/ (made once; a marker file says
    the generation finished, so a run interrupted while writing is redone)."""
    if model:
        path = Path(model).resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {path}: no config.json there")
        return path
    path = OUT_DIR / f"{preset}-seed{seed}"
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        from lm_engine.models.qwen2_vl_make import make_checkpoint

        t = time.perf_counter()
        print(f"generating the {preset} preset into {path} (once)", file=sys.stderr, flush=True)
        make_checkpoint(path, preset=preset, seed=seed)
        print(f"  done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    return path.resolve()


# ---------------------------------------------------------------- CPU accounting (contention)


def _clk() -> int:
    return os.sysconf("SC_CLK_TCK")


def _cpu_busy_total() -> tuple[float, float]:
    """(busy, total) CPU seconds of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals) - idle) / _clk(), sum(vals) / _clk()


def proc_stats():
    """(pid, the fields of /proc/PID/stat after the command name) for every live process; field 4 (ppid) is
    ``fields[1]``, field 5 (pgrp) ``fields[2]``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        yield int(entry.name), stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and ")"


def group_cpu_s(pgid: int | None) -> float:
    """CPU seconds used by the live processes of a process group (plus their reaped children)."""
    if pgid is None:
        return 0.0
    total = sum(
        sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        for _, fields in proc_stats()
        if int(fields[2]) == pgid
    )
    return total / _clk()


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class CpuMeter:
    """The share of the machine's CPUs other processes (not us, not the server's group) took meanwhile."""

    pgid: int | None = None
    _t0: tuple[float, float] = (0.0, 0.0)
    _ours0: float = 0.0
    _wall0: float = 0.0
    result: dict = field(default_factory=dict)

    def __enter__(self) -> CpuMeter:
        self._t0 = _cpu_busy_total()
        self._server0 = group_cpu_s(self.pgid)
        self._ours0 = own_cpu_s() + self._server0
        self._wall0 = time.perf_counter()
        self._load0 = os.getloadavg()[0]
        return self

    def __exit__(self, *exc) -> None:
        busy1, total1 = _cpu_busy_total()
        ours = own_cpu_s() + group_cpu_s(self.pgid) - self._ours0
        total = max(1e-9, total1 - self._t0[1])
        others = max(0.0, (busy1 - self._t0[0]) - ours)
        server = group_cpu_s(self.pgid) - self._server0
        self.result = {
            "wall_s": time.perf_counter() - self._wall0,
            "server_cpu_s": server,
            "cpu_capacity_s": total,
            "ours_cpu_s": ours,
            "others_cpu_s": others,
            "others_share": others / total,
            "loadavg_1m_before": self._load0,
            "loadavg_1m_after": os.getloadavg()[0],
        }


def machine() -> dict:
    info = load._machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    with contextlib.suppress(Exception):
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["transformers"] = transformers.__version__
    info["gpu"] = None
    if os.environ.get("VLMSERVE_EMULATED_ISA"):  # benchmarks/as_avx2.sh
        info["emulated_isa"] = os.environ["VLMSERVE_EMULATED_ISA"]
    return info


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if this (the parent) process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server in its own session/process group: started, health-checked, always stopped with its group."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
    ) -> None:
        self.name, self.argv, self.port, self.log_path = name, argv, port, log_path
        self.env = {**os.environ, **(env or {})}
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0, poll_s: float = 0.5) -> ServerProcess:
        """Start it and wait for its health check (every ``poll_s``: the start-up time is measured to that)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_f = open(self.log_path, "wb")  # noqa: SIM115 (the child keeps it; closed in stop())
        self._log_f = log_f
        t0 = time.perf_counter()
        print(f"[{self.name}] starting: {' '.join(self.argv)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log_f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: one killpg reaches its workers too
            preexec_fn=_die_with_parent,
        )
        self.pgid = self.proc.pid
        deadline = t0 + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} during startup; "
                        f"log tail:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        break
                if time.perf_counter() > deadline:
                    raise RuntimeError(
                        f"{self.name} not healthy after {timeout_s:.0f} s; log tail:\n{self.log_tail()}"
                    )
                time.sleep(poll_s)
        self.startup_s = time.perf_counter() - t0
        print(f"[{self.name}] healthy after {self.startup_s:.1f} s on {self.base_url}", file=sys.stderr)
        return self

    def _group_alive(self) -> bool:
        if self.pgid is None:
            return False
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGINT (graceful), then SIGTERM, then SIGKILL to the whole group; waits until it is gone."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None and not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()
                if self.proc.returncode is not None and not self._group_alive():
                    break
                time.sleep(0.1)
        self.proc.poll()
        with contextlib.suppress(Exception):
            self._log_f.close()
        print(f"[{self.name}] stopped (exit {self.proc.returncode})", file=sys.stderr, flush=True)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def vlmserve_argv(model: Path | None, port: int, extra: Sequence[str] = ()) -> list[str]:
    """The venv's ``vlmserve serve`` on loopback; ``model`` None: the embedded demo model (no ``--model``)."""
    return [
        str(VENV_BIN / "vlmserve"),
        "serve",
        *(["--model", str(model)] if model is not None else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        *extra,
    ]


def vlmserve_here_argv(model: Path | None, port: int, extra: Sequence[str] = ()) -> list[str]:
    """``vlmserve_argv`` as this interpreter runs it from the repository root (``python -m api.cli``): a copied
    virtual environment's entry-point script may run another checkout's interpreter and code, and a benchmark
    must measure the code it sits beside."""
    return [sys.executable, "-m", "api.cli", *vlmserve_argv(model, port, extra)[1:]]


def matching_dtype(model: Path) -> str:
    """The dtype vlmserve computes this checkpoint in with --dtype auto (float32 for a bf16 checkpoint on a
    CPU slow at bf16), so that transformers serve is given the same arithmetic and not a 100× slower one."""
    from lm_engine.config import EngineConfig
    from lm_engine.models.qwen2_vl import Qwen2VLConfig

    dtype = EngineConfig(str(model)).resolve_dtype(Qwen2VLConfig.from_dir(model).dtype)
    return str(dtype).removeprefix("torch.")


def transformers_argv(model: Path, port: int, extra: Sequence[str] = (), dtype: str = "auto") -> list[str]:
    # NOTE: transformers 5.24: `transformers serve [OPTIONS] [FORCE_MODEL]`; a local directory as FORCE_MODEL
    # is loaded at startup and served under its path as the model id.
    return [
        str(VENV_BIN / "transformers"),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        dtype,
        *extra,
        str(model),
    ]


# ---------------------------------------------------------------- /metrics


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """``name`` or ``name{labels}`` → value, for every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def scrape(base_url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        resp = await client.get(base_url + "/metrics")
        resp.raise_for_status()
        return parse_prometheus(resp.text)


async def settled_metrics(base_url: str, timeout_s: float = 60.0) -> dict:
    """Scrape until nothing runs or waits (aborted requests take a step to leave), then judge leaks."""
    t0 = time.perf_counter()
    while True:
        m = await scrape(base_url)
        idle = (
            m.get("vlmserve_num_requests_running", -1) == 0
            and m.get("vlmserve_num_requests_waiting", -1) == 0
        )
        if idle or time.perf_counter() - t0 > timeout_s:
            break
        await asyncio.sleep(0.5)
    free, total = m.get("vlmserve_kv_cache_blocks_free"), m.get("vlmserve_kv_cache_blocks_total")
    return {
        "settle_s": time.perf_counter() - t0,
        "kv_blocks_free": free,
        "kv_blocks_total": total,
        "running": m.get("vlmserve_num_requests_running"),
        "waiting": m.get("vlmserve_num_requests_waiting"),
        "visual_budget_level": m.get("vlmserve_visual_budget_level"),
        "requests_by_status": {
            k.split('status="')[1].rstrip('"}'): v
            for k, v in m.items()
            if k.startswith("vlmserve_requests_total{")
        },
        "preemptions": m.get("vlmserve_num_preemptions_total"),
        "no_leak": free is not None and free == total and idle,
    }


# ---------------------------------------------------------------- driving


class NamedMode(load.LoadMode):
    """A LoadMode whose plot label is the server's name (load.write_plots labels lines by mode)."""

    def __init__(self, name: str, mode: load.LoadMode) -> None:
        super().__init__(mode.rate, mode.concurrency, mode.duration_s, mode.request_timeout_s)
        self.name = name

    def label(self) -> str:
        return self.name


async def drive(
    base_url: str,
    trace: load.Trace,
    images: load.ImageStore,
    mode: load.LoadMode,
    *,
    dialect: str = "openai",
    warmup: int = 2,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    model: str | None = None,
) -> tuple[load.RunResult, dict, str]:
    """Warm up (one at a time, unmeasured), run the trace, summarize."""
    v1 = base_url + "/v1"
    model = model or await load.discover_model(v1)
    target = load.Target(v1, model, ignore_eos=True, dialect=dialect)
    await warm_up(target, warmup, mode.request_timeout_s)
    res = await load.run_load(trace, images, target, mode, progress_every_s=15.0)
    return res, summarize_run(res, slo_ttft_ms, slo_tpot_ms), model


async def warm_up(target: load.Target, n: int, request_timeout_s: float) -> None:
    """``n`` unmeasured 224² requests, one at a time; prints how they went."""
    if not n:
        return
    wt = load._warmup_trace(n)
    wi = load.ImageStore(wt)
    wi.prepare(1)
    warm = await load.run_load(
        wt, wi, target, load.LoadMode(concurrency=1, request_timeout_s=request_timeout_s)
    )
    bad = [r for r in warm.records if not r.ok]
    print(
        f"  warm-up: {len(warm.records) - len(bad)}/{len(warm.records)} ok, "
        f"{', '.join(f'{r.e2e_s:.1f}' for r in warm.records)} s",
        file=sys.stderr,
        flush=True,
    )
    for r in bad[:3]:
        print(f"  warm-up error: {r.error_kind} {r.status}: {r.error}", file=sys.stderr)


def summarize_run(res: load.RunResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    return load.summarize(
        res.records,
        duration_s=res.duration_s,
        planned=res.planned,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def compare_table(rows: list[tuple[str, dict]], ratios: dict) -> str:
    head = (
        "| server | ok/sent | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p50 ms "
        "| prompt tok mean | failed |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['ok']}/{s['sent']} | {s['request_throughput']:.3f} | {s['output_token_throughput']:.1f} "
            f"| {_fmt(s['ttft_ms']['p50'], '.0f')} | {_fmt(s['ttft_ms']['p99'], '.0f')} "
            f"| {_fmt(s['tpot_ms']['p50'], '.1f')} | {_fmt(s['e2e_ms']['p50'], '.0f')} "
            f"| {_fmt(s['prompt_tokens_mean'], '.0f')} | {s['failed']} |"
        )
    lines.append("")
    lines.append("| ratio (vlmserve / transformers serve) | measured | target | met |\n|---|---|---|---|")
    for key, label, target, better in (
        ("request_throughput", "request throughput", 4.0, "ge"),
        ("ttft_p50", "p50 TTFT", 0.5, "le"),
    ):
        r = ratios.get(key)
        met = None if r is None else (r >= target if better == "ge" else r <= target)
        sign = "≥" if better == "ge" else "≤"
        lines.append(
            f"| {label} | {_fmt(r)}× | {sign} {target:g}× | {'yes' if met else 'NO' if met is not None else '-'} |"
        )
    for key, label in (("output_token_throughput", "output token throughput"), ("e2e_p50", "p50 E2E")):
        lines.append(f"| {label} | {_fmt(ratios.get(key))}× | | |")
    return "\n".join(lines)


def cpu_note(runs: dict[str, dict]) -> str:
    """Server CPU seconds per completed request: a contention-robust view of the same comparison."""
    per = {}
    for name, v in runs.items():
        ok, cpu = v["summary"]["ok"], v["cpu"].get("server_cpu_s")
        per[name] = cpu / ok if ok and cpu else None
    text = "server CPU seconds per completed request: " + ", ".join(
        f"{k} {_fmt(x, '.2f')}" for k, x in per.items()
    )
    vals = list(per.values())
    if len(vals) == 2 and vals[0] and vals[1]:
        text += f" (vlmserve uses {vals[0] / vals[1]:.2f}× the CPU per request)"
    return text


def contention_note(meters: dict[str, dict]) -> str:
    worst = max((m.get("others_share", 0.0) for m in meters.values()), default=0.0)
    parts = ", ".join(f"{k}: {100 * m['others_share']:.0f}%" for k, m in meters.items() if m)
    note = f"CPU share taken by other processes during each run: {parts}."
    if worst > 0.1:
        note += (
            " WARNING: the machine was contended (>10%); absolute numbers are pessimistic, ratios noisier."
        )
    return note


# ---------------------------------------------------------------- the compare run


def build_trace(args: argparse.Namespace) -> load.Trace:
    spec = load.TraceSpec(
        num_requests=args.num_requests,
        seed=args.seed,
        resolutions=load.parse_weighted(args.resolutions),
        formats=load.parse_weighted(args.formats),
        max_tokens=(args.max_tokens, args.max_tokens),
    )
    return load.make_trace(spec)


def prepare_images(trace: load.Trace) -> load.ImageStore:
    t = time.perf_counter()
    images = load.ImageStore(trace, OUT_DIR / "load-images")
    images.prepare(2)
    print(
        f"trace {trace.digest()[:12]}: {len(trace.requests)} requests, {len(trace.images)} images "
        f"({images.total_bytes / 1e6:.1f} MB) ready in {time.perf_counter() - t:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return images


def prepare_run(args: argparse.Namespace) -> tuple[Path, load.Trace, load.ImageStore, Path]:
    """The checkpoint, the trace (saved to the output directory) and its images."""
    model = ensure_checkpoint(args.preset, args.checkpoint_seed, args.model)
    trace = build_trace(args)
    images = prepare_images(trace)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load.save_trace(trace, out_dir / "trace.json")
    return model, trace, images, out_dir


def results_header(tool: str, args: argparse.Namespace, model: Path, mach: dict) -> dict:
    """The fields every results.json starts with: what ran, when, where, with which settings."""
    return {
        "tool": tool,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": mach,
        "config": vars(args) | {"checkpoint": str(model)},
    }


def run_compare(args: argparse.Namespace) -> int:
    model, trace, images, out_dir = prepare_run(args)
    mode = load.LoadMode(concurrency=args.clients, request_timeout_s=args.request_timeout_s)
    log_dir = OUT_DIR / "serve_compare"

    runs: dict[str, dict] = {}
    results: list[load.RunResult] = []
    summaries: list[dict] = []
    ours_extra = ["--visual-budget", args.visual_budget or "fixed", *args.vlmserve_arg]
    servers = [("vlmserve", vlmserve_argv, ours_extra, "openai", {})]
    if not args.skip_transformers:
        servers.append(
            (
                "transformers serve",
                functools.partial(transformers_argv, dtype=args.transformers_dtype or matching_dtype(model)),
                args.transformers_arg,
                "transformers",
                {"HF_HUB_OFFLINE": "1"},
            )
        )
    for name, make_argv, extra, dialect, env in servers:
        port = free_port()
        argv = make_argv(model, port, extra)
        server = ServerProcess(name, argv, port, log_dir / f"{name.split()[0]}.log", env=env)
        with server:
            server.start(args.startup_timeout_s)
            with CpuMeter(server.pgid) as meter:
                res, s, served = asyncio.run(
                    drive(
                        server.base_url,
                        trace,
                        images,
                        mode,
                        dialect=dialect,
                        warmup=args.warmup,
                        slo_ttft_ms=args.slo_ttft_ms,
                        slo_tpot_ms=args.slo_tpot_ms,
                    )
                )
            after = asyncio.run(settled_metrics(server.base_url)) if name == "vlmserve" else None
        print(load.format_summary(s, f"{name} ({mode.label()})"), flush=True)
        if after is not None:
            print(
                f"  /metrics after: KV blocks free {after['kv_blocks_free']:.0f}/{after['kv_blocks_total']:.0f}, "
                f"running {after['running']:.0f}, waiting {after['waiting']:.0f} → "
                f"{'no leak' if after['no_leak'] else 'LEAK'}",
                flush=True,
            )
        print(f"  {contention_note({name: meter.result})}", flush=True)
        results.append(load.RunResult(NamedMode(name, res.mode), res.records, res.planned, res.duration_s))
        summaries.append(s)
        runs[name] = {
            "argv": argv,
            "env": env,
            "model": served,
            "dialect": dialect,
            "startup_s": server.startup_s,
            "summary": s,
            "metrics_after": after,
            "cpu": meter.result,
            "records": [r.to_json() for r in res.records],
        }

    ours = runs["vlmserve"]["summary"]
    theirs = runs.get("transformers serve", {}).get("summary")
    ratios = {}
    if theirs is not None:
        ratios = {
            "request_throughput": _ratio(ours["request_throughput"], theirs["request_throughput"]),
            "output_token_throughput": _ratio(
                ours["output_token_throughput"], theirs["output_token_throughput"]
            ),
            "ttft_p50": _ratio(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
            "e2e_p50": _ratio(ours["e2e_ms"]["p50"], theirs["e2e_ms"]["p50"]),
        }
    table = compare_table([(k, v["summary"]) for k, v in runs.items()], ratios)
    meters = {k: v["cpu"] for k, v in runs.items()}
    label = f"{args.preset} preset" if not args.model else str(model)
    if args.preset == "tiny" and not args.model:
        label += " (SMOKE RUN: the tiny preset, not the benchmark's small one)"
    header = (
        f"checkpoint: {label}; {len(trace.requests)} requests, {mode.label()}, max_tokens {args.max_tokens} "
        f"(generated in full), vlmserve --visual-budget {args.visual_budget or 'fixed'}, resolutions {args.resolutions}, formats {args.formats}, seed {args.seed}, "
        f"trace {trace.digest()[:12]}{' [QUICK]' if args.quick else ''}"
    )
    print("\n" + header + "\n" + table + "\n" + cpu_note(runs) + "\n" + contention_note(meters), flush=True)

    mach = machine()
    failed = {k: v["summary"]["failed"] for k, v in runs.items()}
    body = {
        **results_header("benchmarks/serve_compare.py", args, model, mach),
        "trace": {"digest": trace.digest(), "spec": trace.spec, "path": "trace.json"},
        "ratios": ratios,
        "targets": {"request_throughput": ">= 4", "ttft_p50": "<= 0.5"},
        "failed": failed,
        "contention": meters,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "records"} for k, v in runs.items()},
    }
    (out_dir / "results.json").write_text(json.dumps(body, indent=1, default=float) + "\n")
    (out_dir / "records.json").write_text(
        json.dumps({k: v["records"] for k, v in runs.items()}, default=float) + "\n"
    )
    md = [
        "# vlmserve vs transformers serve",
        "",
        f"`{body['command']}` — {body['created']}",
        "",
        header,
        "",
        table,
        "",
        cpu_note(runs) + ".",
        "",
        contention_note(meters),
        "",
        f"Machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpus']} CPUs, {mach.get('mem_gib')} GiB, "
        f"no GPU; {mach['platform']}; Python {mach['python']}, torch {mach.get('torch')}, "
        f"transformers {mach.get('transformers')}.",
        "",
    ]
    for k, v in runs.items():
        md.append(f"- {k}: `{' '.join(v['argv'])}`" + (f" (env {v['env']})" if v["env"] else ""))
        md.append(f"  startup {v['startup_s']:.1f} s")
        if v["metrics_after"]:
            a = v["metrics_after"]
            md.append(
                f"  /metrics after the run: KV blocks free {a['kv_blocks_free']:.0f} / {a['kv_blocks_total']:.0f}, "
                f"running {a['running']:.0f}, waiting {a['waiting']:.0f} ({'no leak' if a['no_leak'] else 'LEAK'})"
            )
    md += [
        "",
        "Plots: `ttft_cdf.png`, `e2e_cdf.png`. Per-request records: `records.json`. Trace: `trace.json`.",
    ]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    load.write_plots(results, summaries, out_dir)
    print(
        f"wrote {out_dir}/results.json, results.md, records.json, trace.json, ttft_cdf.png, e2e_cdf.png",
        file=sys.stderr,
    )
    leak = runs["vlmserve"]["metrics_after"] and not runs["vlmserve"]["metrics_after"]["no_leak"]
    return 1 if leak or any(failed.values()) else 0


# ---------------------------------------------------------------- the overload run


def run_overload(args: argparse.Namespace) -> int:
    """vlmserve alone with admission bounds, at a rate it cannot sustain: only fast 503s, no leaked block."""
    model, trace, images, out_dir = prepare_run(args)
    mode = load.LoadMode(rate=args.rate, request_timeout_s=args.request_timeout_s)
    extra = [
        "--max-queued-requests",
        str(args.max_queued_requests),
        "--max-queued-tokens",
        str(args.max_queued_tokens),
        *(["--visual-budget", args.visual_budget] if args.visual_budget else []),
        *args.vlmserve_arg,
    ]
    port = free_port()
    argv = vlmserve_argv(model, port, extra)
    server = ServerProcess("vlmserve", argv, port, OUT_DIR / "serve_compare" / "overload.log")
    with server:
        server.start(args.startup_timeout_s)
        before = asyncio.run(scrape(server.base_url))
        with CpuMeter(server.pgid) as meter:
            res, s, _ = asyncio.run(
                drive(
                    server.base_url,
                    trace,
                    images,
                    mode,
                    warmup=args.warmup,
                    slo_ttft_ms=args.slo_ttft_ms,
                    slo_tpot_ms=args.slo_tpot_ms,
                )
            )
        after = asyncio.run(settled_metrics(server.base_url))
    print(load.format_summary(s, f"vlmserve overload ({mode.label()}, {' '.join(extra)})"), flush=True)
    refused = [r for r in res.records if r.status == 503 and r.error_kind == "http"]
    other = [r for r in res.records if not r.ok and not (r.status == 503 and r.error_kind == "http")]
    lat = load._dist([r.e2e_s for r in refused], 1e3)
    with_retry_after = sum("retry-after" in r.headers for r in refused)
    fast = lat["p99"] is not None and lat["p99"] <= args.fast_503_ms
    verdict = {
        "sent": len(res.records),
        "ok": s["ok"],
        "refused_503": len(refused),
        "refused_with_retry_after": with_retry_after,
        "refused_latency_ms": lat,
        "other_failures": len(other),
        "other_failure_kinds": sorted({f"{r.error_kind} {r.status}" for r in other}),
        "fast_503": fast,
        "fast_503_threshold_ms": args.fast_503_ms,
        "no_leak": after["no_leak"],
        "shed_anything": bool(refused),
    }
    passed = bool(refused) and not other and fast and after["no_leak"] and with_retry_after == len(refused)
    lines = [
        f"overload: {len(res.records)} sent at {args.rate:g}/s: {s['ok']} ok, {len(refused)} refused with 503 "
        f"({with_retry_after} with Retry-After), {len(other)} other failures {verdict['other_failure_kinds'] or ''}",
        f"  503 latency ms: p50 {_fmt(lat['p50'], '.1f')}, p99 {_fmt(lat['p99'], '.1f')}, max {_fmt(lat['max'], '.1f')} "
        f"(fast = p99 ≤ {args.fast_503_ms:g} ms: {'yes' if fast else 'NO'})",
        f"  served requests: TTFT p50 {_fmt(s['ttft_ms']['p50'], '.0f')} ms, p99 {_fmt(s['ttft_ms']['p99'], '.0f')} ms",
        f"  /metrics after: KV blocks free {after['kv_blocks_free']:.0f}/{after['kv_blocks_total']:.0f}, running "
        f"{after['running']:.0f}, waiting {after['waiting']:.0f}, requests {after['requests_by_status']} → "
        f"{'no leak' if after['no_leak'] else 'LEAK'}",
        f"  {'PASS' if passed else 'FAIL'}"
        + ("" if refused else " (nothing was shed: raise --rate or lower the bounds)"),
        "  " + contention_note({"overload": meter.result}),
    ]
    print("\n".join(lines), flush=True)
    mach = machine()
    body = {
        **results_header("benchmarks/serve_compare.py --overload", args, model, mach),
        "argv": argv,
        "startup_s": server.startup_s,
        "trace": {"digest": trace.digest(), "spec": trace.spec, "path": "trace.json"},
        "verdict": verdict | {"pass": passed},
        "summary": s,
        "metrics_before": {k: v for k, v in before.items() if k.startswith("vlmserve_")},
        "metrics_after": after,
        "cpu": meter.result,
    }
    (out_dir / "results.json").write_text(json.dumps(body, indent=1, default=float) + "\n")
    (out_dir / "records.json").write_text(
        json.dumps([r.to_json() for r in res.records], default=float) + "\n"
    )
    label = f"{args.preset} preset" if not args.model else str(model)
    md = [
        "# vlmserve under overload (admission control)",
        "",
        f"`{body['command']}` — {body['created']}",
        "",
        f"checkpoint: {label}{' (SMOKE RUN: tiny preset)' if args.preset == 'tiny' and not args.model else ''}; "
        f"`{' '.join(argv)}`; Poisson arrivals at {args.rate:g} req/s, {len(trace.requests)} requests, "
        f"max_tokens {args.max_tokens}, trace {trace.digest()[:12]}{' [QUICK]' if args.quick else ''}",
        "",
        "```",
        load.format_summary(s, f"vlmserve overload ({mode.label()})"),
        *lines,
        "```",
        "",
        f"Machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpus']} CPUs, {mach.get('mem_gib')} GiB, no GPU.",
    ]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    load.write_plots([res], [s], out_dir)
    print(f"wrote {out_dir}/results.json, results.md, records.json, plots", file=sys.stderr)
    return 0 if passed else 1


# ---------------------------------------------------------------- CLI


def add_common_args(p: argparse.ArgumentParser, *, requests: str, max_tokens: str) -> None:
    """The checkpoint, trace and timeout options this script shares with visual_budget.py."""
    p.add_argument("--preset", default="small", choices=["tiny", "small"], help="generated checkpoint")
    p.add_argument("--checkpoint-seed", type=int, default=0)
    p.add_argument("--model", help="serve this checkpoint directory instead of a generated preset")
    p.add_argument("-n", "--num-requests", type=int, help=f"requests in the trace ({requests})")
    p.add_argument("--max-tokens", type=int, help=f"generated in full ({max_tokens})")
    p.add_argument("--resolutions", default=load.DEFAULT_RESOLUTIONS)
    p.add_argument("--formats", default="jpeg,png")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured 224² requests per server first")
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--startup-timeout-s", type=float, default=900.0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="serve_compare.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="shrink: 16 requests, 8 clients, max_tokens 32")
    p.add_argument("--overload", action="store_true", help="the admission-control overload check instead")
    add_common_args(p, requests="default 64; --quick 16", max_tokens="default 128; --quick 32")
    p.add_argument("--clients", type=int, help="concurrent clients (default 16; --quick 8)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--skip-transformers", action="store_true", help="vlmserve only")
    p.add_argument(
        "--visual-budget",
        choices=["fixed", "adaptive"],
        help="vlmserve's visual budget (compare default: fixed, the same visual tokens as transformers serve, "
        "so both do the same work; --overload default: the server's own, adaptive)",
    )
    p.add_argument(
        "--vlmserve-arg", action="append", default=[], help="extra `vlmserve serve` argument (repeatable)"
    )
    p.add_argument(
        "--transformers-dtype",
        help="transformers serve --dtype (default: what vlmserve's auto resolves to here, e.g. float32 for the "
        "bf16 preset on a CPU without fast bf16; 'auto' gives it the checkpoint's bf16)",
    )
    p.add_argument(
        "--transformers-arg",
        action="append",
        default=[],
        help="extra `transformers serve` argument (repeatable), e.g. --transformers-arg=--continuous-batching",
    )
    g = p.add_argument_group("--overload")
    g.add_argument("--rate", type=float, help="Poisson arrivals/s (default 8; --quick 8)")
    g.add_argument("--max-queued-requests", type=int, default=4)
    g.add_argument("--max-queued-tokens", type=int, default=8192)
    g.add_argument(
        "--fast-503-ms", type=float, default=1000.0, help="a refusal is fast when p99 is under this"
    )
    p.add_argument("--out-dir", help="default benchmarks/results/serve_compare (or .../overload)")
    args = p.parse_args(argv)
    q = args.quick
    if args.overload:
        args.num_requests = args.num_requests or (24 if q else 64)
        args.max_tokens = args.max_tokens or (32 if q else 128)
        args.rate = args.rate or 8.0
        args.out_dir = args.out_dir or str(RESULTS_DIR / "overload")
        args.request_timeout_s = min(args.request_timeout_s, 600.0)
    else:
        args.num_requests = args.num_requests or (16 if q else 64)
        args.max_tokens = args.max_tokens or (32 if q else 128)
        args.out_dir = args.out_dir or str(RESULTS_DIR / "serve_compare")
    args.clients = args.clients or (8 if q else 16)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame) -> None:  # SIGTERM: unwind like Ctrl-C, so finally-blocks stop servers
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)  # NOTE: not SIGHUP: nohup's ignoring it must stand
    try:
        return run_overload(args) if args.overload else run_compare(args)
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped, nothing written for the unfinished run", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
