"""Goodput under overload with the visual budget controller (``--visual-budget adaptive``) against ``fixed``.

One server, one arrival trace of mixed-resolution images (224² … 2048×1536, Poisson arrivals) sent at about
twice the rate the server sustains at full resolution, run twice on a freshly started server (cold caches):
once with ``--visual-budget fixed``, once with ``adaptive``. The sustainable rate is measured first by a short
closed-loop calibration run at the fixed budget (or given with ``--rate``/``--sustainable-rate``). Reported
for both: goodput (requests/s meeting both ``--slo-ttft-ms`` and ``--slo-tpot-ms``), p50/p99 TTFT, requests
shed (503, with their latency), any other failure (must be 0), the visual budget levels the images got
(``usage.visual_levels`` and the ``X-Visual-Budget-Levels`` header) and the level over time (``/metrics``),
and the ratio adaptive/fixed goodput (target ≥ 2×).

    .venv/bin/python benchmarks/visual_budget.py                       # calibrate, then fixed and adaptive
    .venv/bin/python benchmarks/visual_budget.py --quick               # 24 requests, max_tokens 32
    .venv/bin/python benchmarks/visual_budget.py --sustainable-rate 0.1 --slo-ttft-ms 8000 --slo-tpot-ms 400

The server gets ``--ttft-slo-ms`` = ``--slo-ttft-ms`` (the controller aims at the SLO the goodput counts).
Results go to ``benchmarks/results/visual_budget/``; server logs to ``benchmarks/out/visual_budget/``.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import load
from benchmarks.harness import (
    OUT_DIR,
    NamedMode,
    ServerProcess,
    add_common_args,
    add_run_args,
    arg_parser,
    build_trace,
    bulk_dir,
    checkpoint_label,
    contention_note,
    ensure_checkpoint,
    fmt,
    free_port,
    machine,
    machine_line,
    prepare_images,
    quick_or_full,
    refusals,
    results_header,
    run_main,
    run_on,
    scrape,
    summarize_run,
    trace_entry,
    vlmserve_argv,
    warm_up,
    write_results,
)

LOG_DIR = OUT_DIR / "visual_budget"


async def _poll_levels(base_url: str, t0: float, samples: list, every_s: float = 0.25) -> None:
    """(seconds since the run's start, level, waiting, running, kv usage) from /metrics until cancelled."""
    while True:
        with contextlib.suppress(Exception):
            m = await scrape(base_url)
            samples.append(
                (
                    time.perf_counter() - t0,
                    m.get("vlmserve_visual_budget_level"),
                    m.get("vlmserve_num_requests_waiting"),
                    m.get("vlmserve_num_requests_running"),
                    m.get("vlmserve_kv_cache_usage_perc"),
                )
            )
        await asyncio.sleep(every_s)


async def measured_run(
    base_url: str,
    trace: load.Trace,
    images: load.ImageStore,
    mode: load.LoadMode,
    warmup: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    ignore_eos: bool = True,
) -> tuple[load.RunResult, dict, list]:
    """``ignore_eos``: every request generates its max_tokens (equal decode work); False for scored replies."""
    v1 = base_url + "/v1"
    target = load.Target(v1, await load.discover_model(v1), ignore_eos=ignore_eos)
    if warmup:
        await warm_up(target, warmup, mode.request_timeout_s)
        await asyncio.sleep(2.0)  # let the controller see an idle engine again before the trace starts
    samples: list = []
    poller = asyncio.create_task(_poll_levels(base_url, time.perf_counter(), samples))
    try:
        res = await load.run_load(trace, images, target, mode, progress_every_s=15.0)
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    return res, summarize_run(res, slo_ttft_ms, slo_tpot_ms), samples


# What --budgets may name: the server's two visual budgets, and a fixed one with admission control by the
# TTFT SLO (--slo-admission, on by default only with adaptive): what refusing work alone buys, without the ladder.
BUDGETS = ("fixed", "fixed+admission", "adaptive")


def server_extra(args: argparse.Namespace, budget: str) -> list[str]:
    mode, _, admission = budget.partition("+")
    extra = ["--visual-budget", mode, "--ttft-slo-ms", f"{args.server_ttft_slo_ms:g}"]
    if admission:
        extra.append("--slo-admission")
    if args.slo_tpot_ms and not args.no_server_tpot:
        extra += ["--tpot-slo-ms", f"{args.slo_tpot_ms:g}"]  # both runs: prefill beside streams fits the SLO
    if args.max_queued_requests is not None:
        extra += ["--max-queued-requests", str(args.max_queued_requests)]
    if args.max_queued_tokens is not None:
        extra += ["--max-queued-tokens", str(args.max_queued_tokens)]
    return extra + list(args.vlmserve_arg)


ArgvFn = Callable[[Path, int, Sequence[str]], list[str]]  # (model, port, extra) → the server's command line


def serve_and_drive(
    args: argparse.Namespace,
    name: str,
    argv: list[str],
    port: int,
    log_path: Path,
    trace: load.Trace,
    images: load.ImageStore,
    mode: load.LoadMode,
    ignore_eos: bool = True,
) -> dict:
    """A freshly started server through the trace: the run, its summary, the level samples, the CPU meter,
    ``/metrics`` once it settled and its start-up time, as a dict."""

    async def go(base_url: str) -> tuple[load.RunResult, dict, list]:
        slo = (args.slo_ttft_ms, args.slo_tpot_ms)
        return await measured_run(base_url, trace, images, mode, args.warmup, *slo, ignore_eos=ignore_eos)

    server = ServerProcess(name, argv, port, log_path)
    (res, s, samples), cpu, after = run_on(server, args.startup_timeout_s, go)
    return {
        "res": res,
        "summary": s,
        "samples": samples,
        "cpu": cpu,
        "after": after,
        "startup_s": server.startup_s,
    }


def calibrate_with(
    args: argparse.Namespace,
    model: Path,
    make_argv: ArgvFn,
    trace: load.Trace,
    images: load.ImageStore,
    log_path: Path,
    ignore_eos: bool = True,
) -> dict:
    """Closed loop at --calib-clients on a fixed-budget server: completed requests per second."""
    port = free_port()
    argv = make_argv(model, port, server_extra(args, "fixed"))
    mode = load.LoadMode(concurrency=args.calib_clients, request_timeout_s=args.request_timeout_s)
    r = serve_and_drive(args, "vlmserve calibration", argv, port, log_path, trace, images, mode, ignore_eos)
    s = r["summary"]
    print(load.format_summary(s, f"calibration, fixed budget ({mode.label()})"), flush=True)
    if s["ok"] == 0:
        raise SystemExit(f"calibration: no request succeeded; see {log_path}")
    return {
        "argv": argv,
        "mode": mode.label(),
        "requests": len(trace.requests),
        "trace_digest": trace.digest(),
        "sustainable_rate": s["request_throughput"],
        "summary": s,
        "cpu": r["cpu"],
    }


def offered_rate(args: argparse.Namespace, calibrate: Callable[[], dict]) -> tuple[dict | None, float, float]:
    """(the calibration or None, the sustainable rate, the offered rate): --rate as given, else
    --overload-factor × --sustainable-rate, else × what ``calibrate()`` measured."""
    calib = None
    sustainable = args.sustainable_rate
    if args.rate is None and sustainable is None:
        calib = calibrate()
        sustainable = calib["sustainable_rate"]
        print(f"sustainable rate at the full budget: {sustainable:.4f} req/s", flush=True)
    rate = args.rate if args.rate is not None else args.overload_factor * sustainable
    return calib, sustainable, rate


def run_budget(
    args: argparse.Namespace,
    budget: str,
    model: Path,
    make_argv: ArgvFn,
    log_path: Path,
    trace: load.Trace,
    images: load.ImageStore,
    mode: load.LoadMode,
    ignore_eos: bool = True,
) -> tuple[dict, load.RunResult]:
    """One freshly started server at ``budget`` through the trace: (its run entry for results.json, the run)."""
    port = free_port()
    argv = make_argv(model, port, server_extra(args, budget))
    got = serve_and_drive(args, f"vlmserve {budget}", argv, port, log_path, trace, images, mode, ignore_eos)
    res, s, samples, after = got["res"], got["summary"], got["samples"], got["after"]
    shed, other = refusals(res.records)
    header_levels = Counter()
    for r in res.records:
        if r.ok and (h := r.headers.get("x-visual-budget-levels")):
            header_levels.update(x.strip() for x in h.split(","))
    v = {
        "shed": len(shed),
        "shed_latency_ms": load._dist([r.e2e_s for r in shed], 1e3),
        "shed_with_retry_after": sum("retry-after" in r.headers for r in shed),
        "other_failures": len(other),
        "other_failure_examples": [f"{r.error_kind} {r.status}: {r.error}" for r in other[:5]],
        "levels": level_counts(s),
        "header_levels": dict(sorted(header_levels.items())),
        "max_level_seen_in_metrics": max((x[1] for x in samples if x[1] is not None), default=None),
    }
    print(load.format_summary(s, f"--visual-budget {budget} ({mode.label()})"), flush=True)
    print(
        f"  shed {v['shed']} (503 latency p99 {fmt(v['shed_latency_ms']['p99'], '.0f')} ms), other failures "
        f"{v['other_failures']}, levels {v['levels']}, header {v['header_levels']}, highest level in "
        f"/metrics {v['max_level_seen_in_metrics']}; after: KV free {after['kv_blocks_free']:.0f}/"
        f"{after['kv_blocks_total']:.0f} → {'no leak' if after['no_leak'] else 'LEAK'}",
        flush=True,
    )
    print("  " + contention_note({budget: got["cpu"]}), flush=True)
    run = {
        "argv": argv,
        "startup_s": got["startup_s"],
        "summary": s,
        "verdict": v,
        "metrics_after": after,
        "cpu": got["cpu"],
        "level_timeline": [[round(x[0], 3), *x[1:]] for x in samples],
    }
    return run, res


def overload_runs(
    args: argparse.Namespace,
    model: Path,
    make_argv: ArgvFn,
    calibrate: Callable[[], dict],
    make_trace: Callable[[], tuple[load.Trace, load.ImageStore]],
    log_name: Callable[[str], Path],
    ignore_eos: bool = True,
) -> tuple[dict | None, float, float, load.Trace, dict[str, dict], dict[str, load.RunResult]]:
    """The rate (``offered_rate``), then the trace at it through a fresh server per ``--budgets`` entry:
    (calibration, sustainable rate, offered rate, trace, run entries, runs)."""
    calib, sustainable, rate = offered_rate(args, calibrate)
    trace, images = make_trace()
    mode = load.LoadMode(rate=rate, request_timeout_s=args.request_timeout_s)
    print(
        f"offered rate {rate:.4f} req/s ({len(trace.requests)} requests over "
        f"~{trace.requests[-1].t_unit / rate:.0f} s of arrivals)",
        file=sys.stderr,
        flush=True,
    )
    runs: dict[str, dict] = {}
    results: dict[str, load.RunResult] = {}
    for budget in args.budgets:
        runs[budget], results[budget] = run_budget(
            args, budget, model, make_argv, log_name(budget), trace, images, mode, ignore_eos
        )
    return calib, sustainable, rate, trace, runs, results


def budget_runs_summary(runs: dict[str, dict]) -> dict[str, dict]:
    """The runs as results.json keeps them: without the level timelines (bulky: those go to benchmarks/out/)."""
    return {k: {kk: vv for kk, vv in v.items() if kk != "level_timeline"} for k, v in runs.items()}


def write_budget_bulk(
    runs: dict[str, dict], results: dict[str, load.RunResult], bulk: Path, prefix: str = ""
) -> None:
    """Beside the records: the level timelines (``<prefix>level_timeline.json``), load.py's CDFs (one line per
    budget; all runs share one rate, so no goodput-against-rate plot) and the level and queue over time
    (``<prefix>levels.png``)."""
    timelines = {k: v["level_timeline"] for k, v in runs.items()}
    (bulk / f"{prefix}level_timeline.json").write_text(json.dumps(timelines) + "\n")
    named = []
    for budget, res in results.items():
        mode = NamedMode(budget, res.mode)
        mode.rate = None
        named.append(load.RunResult(mode, res.records, res.planned, res.duration_s))
    load.write_plots(named, [runs[k]["summary"] for k in results], bulk)
    plot_levels(timelines, {k: r.records for k, r in results.items()}, bulk / f"{prefix}levels.png")


def failed_any(runs: dict[str, dict]) -> int:
    """Exit status: 1 on a failure other than a 503, or a leaked KV block."""
    return int(
        any(v["verdict"]["other_failures"] or not v["metrics_after"]["no_leak"] for v in runs.values())
    )


def level_counts(s: dict) -> dict[str, int]:
    return {str(k): int(v) for k, v in s["visual_levels"].items()}


def run_table(rows: list[tuple[str, dict, dict]]) -> str:
    lines = [
        "| budget | ok/sent | shed (503) | 503 p99 ms | other failures | goodput req/s | met SLO | req/s "
        "| TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | visual tok/img mean | levels (per image) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s, v in rows:
        levels = ", ".join(f"L{k}×{n}" for k, n in sorted(v["levels"].items())) or "-"
        lines.append(
            f"| {name} | {s['ok']}/{s['sent']} | {v['shed']} | {fmt(v['shed_latency_ms']['p99'], '.0f')} "
            f"| {v['other_failures']} | {fmt(s['goodput'], '.4f')} | {s['slo']['met']}/{s['sent']} "
            f"| {s['request_throughput']:.4f} | {fmt(s['ttft_ms']['p50'], '.0f')} | {fmt(s['ttft_ms']['p99'], '.0f')} "
            f"| {fmt(s['tpot_ms']['p50'], '.1f')} | {fmt(s['visual_tokens_per_image']['mean'], '.0f')} | {levels} |"
        )
    return "\n".join(lines)


def plot_levels(timelines: dict[str, list], records: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for name, samples in timelines.items():
        if samples:
            t = [x[0] for x in samples]
            ax1.step(t, [x[1] for x in samples], where="post", label=name)
            ax2.plot(t, [x[2] for x in samples], label=f"{name}: waiting")
    for name, recs in records.items():
        shed = [r.start_s for r in recs if r.status == 503]
        if shed:
            ax2.plot(shed, [0] * len(shed), "x", label=f"{name}: 503")
    ax1.set_ylabel("visual budget level\n(0 = full resolution)")
    ax1.invert_yaxis()
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.set_ylabel("requests waiting")
    ax2.set_xlabel("seconds since the trace started")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.suptitle("visual budget level and queue over the run (from /metrics)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibration_trace(args: argparse.Namespace) -> load.Trace:
    """Other images than the measured trace, and the resolution mix exactly (round-robin in proportion to the
    weights) rather than drawn: a short random draw could be all thumbnails or all 2048×1536."""
    trace = build_trace(args, args.calib_n, args.seed + 1000)
    weights = load.parse_weighted(args.resolutions)
    lo = min(weights.values())
    cycle = [
        name
        for name in sorted(weights, key=lambda r: load.parse_resolution(r)[0] * load.parse_resolution(r)[1])
        for _ in range(max(1, round(weights[name] / lo)))
    ]
    for i, img in enumerate(trace.images):
        img.width, img.height = load.parse_resolution(cycle[i % len(cycle)])
    return trace


def main_run(args: argparse.Namespace) -> int:
    model = ensure_checkpoint(args.preset, args.checkpoint_seed, args.model)
    out_dir = Path(args.out_dir)

    def calibrate() -> dict:
        trace = calibration_trace(args)
        return calibrate_with(
            args, model, vlmserve_argv, trace, prepare_images(trace), LOG_DIR / "calibration.log"
        )

    def make_trace() -> tuple[load.Trace, load.ImageStore]:
        trace = build_trace(args)
        return trace, prepare_images(trace)

    calib, sustainable, rate, trace, runs, results = overload_runs(
        args, model, vlmserve_argv, calibrate, make_trace, lambda budget: LOG_DIR / f"{budget}.log"
    )

    ratio = ratio_met = None
    if "fixed" in runs and "adaptive" in runs:
        f, a = runs["fixed"]["summary"], runs["adaptive"]["summary"]
        ratio = a["goodput"] / f["goodput"] if f["goodput"] else (float("inf") if a["goodput"] else None)
        fm, am = f["slo"]["met"], a["slo"]["met"]
        ratio_met = am / fm if fm else (float("inf") if am else None)
    label = checkpoint_label(args, model)
    header = (
        f"checkpoint: {label}; {len(trace.requests)} requests, Poisson {rate:.4f} req/s = "
        f"{rate / sustainable if sustainable else float('nan'):.2f} × the sustainable {fmt(sustainable, '.4f')} req/s"
        f"{' (calibrated: ' + calib['mode'] + ', ' + str(calib['requests']) + ' requests)' if calib else ' (given)'}; "
        f"max_tokens {args.max_tokens} (generated in full); SLO TTFT ≤ {args.slo_ttft_ms:g} ms, "
        f"TPOT ≤ {args.slo_tpot_ms:g} ms (server --ttft-slo-ms {args.server_ttft_slo_ms:g}); "
        f"resolutions {args.resolutions}; trace {trace.digest()[:12]}{' [QUICK]' if args.quick else ''}"
    )
    if "fixed" in runs:  # a check on the calibration: what the fixed run itself sustained under the overload
        sustained = runs["fixed"]["summary"]["request_throughput"]
        header += (
            f"; the fixed run completed {sustained:.4f} req/s, so the offered rate was "
            f"{rate / sustained if sustained else float('nan'):.2f} × what it sustained"
        )
    table = run_table([(k, v["summary"], v["verdict"]) for k, v in runs.items()])
    ratio_line = (
        f"goodput adaptive / fixed: {fmt(ratio)}× (requests meeting both SLOs: {fmt(ratio_met)}×); target ≥ 2×: "
        f"{'met' if ratio is not None and min(ratio, ratio_met or 0) >= 2 else 'NOT met'}"
    )
    meters = {k: v["cpu"] for k, v in runs.items()}
    shares = [m.get("others_share", 0.0) for m in meters.values()]
    if len(shares) == 2 and abs(shares[0] - shares[1]) > 0.15:
        ratio_line += (
            f" — WARNING: the two runs saw different contention ({100 * shares[0]:.0f}% vs "
            f"{100 * shares[1]:.0f}% of the CPUs taken by others): this ratio measures the machine, not the controller"
        )
    print("\n" + header + "\n" + table + "\n" + ratio_line + "\n" + contention_note(meters), flush=True)

    mach = machine()
    body = {
        **results_header("benchmarks/visual_budget.py", args, model, mach),
        "calibration": calib,
        "sustainable_rate": sustainable,
        "offered_rate": rate,
        "trace": trace_entry(trace, out_dir),
        "goodput_ratio": ratio,
        "met_ratio": ratio_met,
        "target": "goodput adaptive/fixed >= 2, no failure other than a fast 503",
        "contention": meters,
        "runs": budget_runs_summary(runs),
    }
    md = [
        header,
        "",
        table,
        "",
        ratio_line,
        "",
        contention_note(meters),
        "",
        machine_line(mach),
        "",
        *[f"- {k}: `{' '.join(v['argv'])}`" for k, v in runs.items()],
        "",
        f"In `{bulk_dir(out_dir)}`: plots `ttft_cdf.png`, `e2e_cdf.png`, `levels.png` (level and queue over "
        "time), per-request records `records.json`, the trace `trace.json`.",
    ]
    bulk = write_results(
        out_dir,
        body,
        "Visual budget: adaptive against fixed under overload",
        md,
        {k: [r.to_json() for r in v.records] for k, v in results.items()},
    )
    load.save_trace(trace, bulk / "trace.json")
    write_budget_bulk(runs, results, bulk)
    return failed_any(runs)


def add_overload_args(
    g: argparse._ActionsContainer, *, slo_ttft_ms: float, calib_clients: int, budgets: str
) -> None:
    """The overload options this script shares with quality_vs_budget.py (``finish_overload_args`` after)."""
    g.add_argument("--rate", type=float, help="offered rate (req/s); skips calibration")
    g.add_argument("--sustainable-rate", type=float, help="skip calibration: the full-budget rate")
    g.add_argument("--overload-factor", type=float, default=2.0, help="offered = factor × sustainable")
    g.add_argument(
        "--calib-clients",
        type=int,
        default=calib_clients,
        help="calibration concurrency (closed loop; a short run at high concurrency ends in one bunched wave "
        "and underestimates the rate, so keep --calib-n at 3× this or more)",
    )
    g.add_argument("--slo-ttft-ms", type=float, default=slo_ttft_ms)
    g.add_argument("--slo-tpot-ms", type=float, default=500.0)
    g.add_argument(
        "--server-ttft-slo-ms", type=float, help="the server's --ttft-slo-ms (default: --slo-ttft-ms)"
    )
    g.add_argument(
        "--no-server-tpot",
        action="store_true",
        help="do not pass --slo-tpot-ms to the servers as --tpot-slo-ms (prefill beside decodes uncapped)",
    )
    g.add_argument("--max-queued-requests", type=int, help="passed to every server")
    g.add_argument("--max-queued-tokens", type=int, help="passed to every server")
    g.add_argument(
        "--budgets",
        default=budgets,
        help="which runs, in order: fixed, fixed+admission (a fixed budget with --slo-admission), adaptive",
    )


def finish_overload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.server_ttft_slo_ms = args.server_ttft_slo_ms or args.slo_ttft_ms
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if bad := set(args.budgets) - set(BUDGETS):
        p.error(f"unknown budgets {sorted(bad)}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arg_parser("visual_budget.py", __doc__)
    p.add_argument("--quick", action="store_true", help="24 requests, max_tokens 32, 12 calibration requests")
    add_common_args(p, requests="default 48; --quick 24", max_tokens="default 64; --quick 32")
    p.add_argument("--calib-n", type=int, help="calibration requests (default 24; --quick 12)")
    add_overload_args(p, slo_ttft_ms=10000.0, calib_clients=8, budgets="fixed,adaptive")
    add_run_args(p, "visual_budget")
    args = p.parse_args(argv)
    quick_or_full(args, num_requests=(24, 48), max_tokens=(32, 64), calib_n=(12, 24))
    finish_overload_args(p, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: main_run(args))


if __name__ == "__main__":
    sys.exit(main())
