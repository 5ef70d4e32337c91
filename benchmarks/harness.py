"""What every benchmark that drives a server shares: where results and bulky outputs go, the generated
checkpoint, servers on 127.0.0.1 (started in their own process group, health-checked, always stopped), the
machine's description and the CPU share others took, ``/metrics``, warm-up, and writing a run's files.

A run writes a small summary to ``benchmarks/results/<name>/`` (``results.json`` and ``results.md``: the
figures the README quotes) and everything bulky (per-request records, traces, plots, server logs) to the
git-ignored ``benchmarks/out/<name>/`` (``bulk_dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from benchmarks import load

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "benchmarks" / "out"  # git-ignored: checkpoints, images, logs, records, traces, plots
RESULTS_DIR = ROOT / "benchmarks" / "results"  # in the tree: small summaries only
VENV_BIN = Path(sys.executable).parent
T = TypeVar("T")

# ---------------------------------------------------------------- checkpoint


def ensure_checkpoint(
    preset: str = "small", seed: int = 0, model: str | Path | None = None, family: str = "qwen2_vl"
) -> Path:
    """``--model`` as given, else the generated preset of ``family`` under benchmarks/out/ (made once; the
    weights and tokenizer files say the generation finished, so a run interrupted while writing is redone)."""
    if model:
        path = Path(model).resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {path}: no config.json there")
        return path
    path = OUT_DIR / (f"{preset}-seed{seed}" if family == "qwen2_vl" else f"{preset}-{family}-seed{seed}")
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        from tools import qwen2_vl_make, qwen3_vl_make

        t = time.perf_counter()
        print(f"generating the {preset} {family} preset into {path} (once)", file=sys.stderr, flush=True)
        if family == "qwen3_vl":
            qwen3_vl_make.make_checkpoint(path, preset=preset, seed=seed)
        else:
            qwen2_vl_make.make_checkpoint(path, preset=preset, seed=seed, family=family)
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


def run_on(
    server: ServerProcess,
    startup_timeout_s: float,
    go: Callable[[str], Awaitable[T]],
    settle: bool = True,
) -> tuple[T, dict, dict | None]:
    """Starts ``server``, runs ``go(base_url)`` under a ``CpuMeter`` and, with ``settle``, reads ``/metrics``
    once the server is idle (``settled_metrics``); the server is stopped however this ends. Returns (what
    ``go`` returned, the meter's figures, the settled metrics or None)."""
    with server:
        server.start(startup_timeout_s)
        with CpuMeter(server.pgid) as meter:
            out = asyncio.run(go(server.base_url))
        after = asyncio.run(settled_metrics(server.base_url)) if settle else None
    return out, meter.result, after


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


def time_each(fn: Callable[[], object], n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``, one after another."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def contention_note(meters: dict[str, dict]) -> str:
    worst = max((m.get("others_share", 0.0) for m in meters.values()), default=0.0)
    parts = ", ".join(f"{k}: {100 * m['others_share']:.0f}%" for k, m in meters.items() if m)
    note = f"CPU share taken by other processes during each run: {parts}."
    if worst > 0.1:
        note += (
            " WARNING: the machine was contended (>10%); absolute numbers are pessimistic, ratios noisier."
        )
    return note


# ---------------------------------------------------------------- the trace and its sizing


def arg_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A script's parser: its file name as ``prog``, its docstring's first paragraph as the description."""
    return argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_common_args(p: argparse.ArgumentParser, *, requests: str, max_tokens: str) -> None:
    """The checkpoint, trace and timeout options of the scripts that drive ``vlmserve serve`` with a trace;
    ``requests`` and ``max_tokens`` say their defaults (each script sizes them, ``--quick`` smaller)."""
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


def add_run_args(p: argparse._ActionsContainer, name: str) -> None:
    """--vlmserve-arg (repeatable: for every server the script starts) and --out-dir (default: results/NAME)."""
    p.add_argument("--vlmserve-arg", action="append", default=[], help="extra `vlmserve serve` argument")
    p.add_argument("--out-dir", default=str(RESULTS_DIR / name))


def quick_or_full(args: argparse.Namespace, **sizes: tuple[int, int]) -> None:
    """Each option named in ``sizes`` that the command line left unset (or 0) takes its (--quick, full run) value."""
    for name, (quick, full) in sizes.items():
        if not getattr(args, name):
            setattr(args, name, quick if args.quick else full)


def build_trace(args: argparse.Namespace, n: int | None = None, seed: int | None = None) -> load.Trace:
    """The trace ``add_common_args`` describes: ``n`` requests (default ``--num-requests``) from ``seed``
    (default ``--seed``), max_tokens generated in full."""
    spec = load.TraceSpec(
        num_requests=args.num_requests if n is None else n,
        seed=args.seed if seed is None else seed,
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


def trace_entry(trace: load.Trace, out_dir: Path) -> dict:
    """results.json's note of the trace: its spec rebuilds it (``load.make_trace``), the digest checks it."""
    return {"digest": trace.digest(), "spec": trace.spec, "path": str(bulk_dir(out_dir) / "trace.json")}


# ---------------------------------------------------------------- results


def results_header(tool: str, args: argparse.Namespace, model: Path, mach: dict) -> dict:
    """The fields every results.json starts with: what ran, when, where, with which settings."""
    return {
        "tool": tool,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": mach,
        "config": vars(args) | {"checkpoint": str(model)},
    }


def checkpoint_label(args: argparse.Namespace, model: Path) -> str:
    """How results name the checkpoint: ``--model``'s path, else the preset (the tiny one marked a smoke run)."""
    if args.model:
        return str(model)
    smoke = " (SMOKE RUN: the tiny preset, not the benchmark's small one)" if args.preset == "tiny" else ""
    return f"{args.preset} preset{smoke}"


def machine_line(mach: dict) -> str:
    """One line for a results.md: the CPU, its count, memory and the software versions."""
    return (
        f"Machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpus']} CPUs, {mach.get('mem_gib')} GiB, "
        f"no GPU; {mach['platform']}; Python {mach['python']}, torch {mach.get('torch')}, "
        f"transformers {mach.get('transformers')}."
    )


def bulk_dir(out_dir: str | Path) -> Path:
    """Where a run's bulky files go: the mirror of ``out_dir`` under benchmarks/out/ when it is under
    benchmarks/results/ (``results/visual_budget`` → ``out/visual_budget``), else ``out_dir`` itself."""
    out_dir = Path(out_dir).resolve()
    with contextlib.suppress(ValueError):
        return OUT_DIR / out_dir.relative_to(RESULTS_DIR)
    return out_dir


def write_results(
    out_dir: str | Path,
    body: dict,
    title: str,
    md: Sequence[str],
    records: object = None,
    *,
    stem: str = "results",
) -> Path:
    """``<stem>.json`` (``body``, which starts with ``results_header``) and ``<stem>.md`` (``title``, the
    command and its date, then ``md``'s lines) in ``out_dir``, the summary kept in the tree; ``records``
    (per-request, JSON-able) to ``<stem[_]>records.json`` in ``bulk_dir(out_dir)``. Returns the bulk
    directory (for the plots and the trace)."""
    out_dir, bulk = Path(out_dir), bulk_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bulk.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(body, indent=1, default=float) + "\n")
    head = [f"# {title}", "", f"`{body['command']}` — {body['created']}", ""]
    (out_dir / f"{stem}.md").write_text("\n".join([*head, *md]) + "\n")
    written = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    if records is not None:
        name = "records.json" if stem == "results" else f"{stem}_records.json"
        (bulk / name).write_text(json.dumps(records, default=float) + "\n")
        written.append(bulk / name)
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    return bulk


# ---------------------------------------------------------------- verdicts


def refusals(records: Sequence[load.RequestRecord]) -> tuple[list, list]:
    """(requests shed with a 503, every other failure): under overload only the first may happen."""
    shed = [r for r in records if r.status == 503 and r.error_kind == "http"]
    other = [r for r in records if not r.ok and not (r.status == 503 and r.error_kind == "http")]
    return shed, other


# ---------------------------------------------------------------- main


def run_main(run: Callable[[], int], what: str = "run") -> int:
    """``run()``, with SIGTERM unwinding like Ctrl-C so that every server is stopped by its ``with``; an
    interrupted run writes nothing. NOTE: not SIGHUP: nohup's ignoring it must stand."""

    def on_term(signum, frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run()
    except KeyboardInterrupt:
        print(f"\ninterrupted: servers stopped, nothing written for the unfinished {what}", file=sys.stderr)
        return 130
