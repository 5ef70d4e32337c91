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

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import load  # noqa: E402
from benchmarks.serve_compare import (  # noqa: E402
    OUT_DIR,
    RESULTS_DIR,
    CpuMeter,
    NamedMode,
    ServerProcess,
    _fmt,
    add_common_args,
    contention_note,
    ensure_checkpoint,
    free_port,
    machine,
    prepare_images,
    results_header,
    scrape,
    settled_metrics,
    summarize_run,
    vlmserve_argv,
    warm_up,
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


def make_trace(args: argparse.Namespace, n: int, seed: int) -> load.Trace:
    return load.make_trace(
        load.TraceSpec(
            num_requests=n,
            seed=seed,
            resolutions=load.parse_weighted(args.resolutions),
            formats=load.parse_weighted(args.formats),
            max_tokens=(args.max_tokens, args.max_tokens),
        )
    )


def calibrate(args: argparse.Namespace, model: Path) -> dict:
    """Closed loop at --calib-clients on a fixed-budget server: completed requests per second."""
    # NOTE: other images than the measured trace, and the resolution mix exactly (round-robin in proportion
    # to the weights) rather than drawn: a short random draw could be all thumbnails or all 2048×1536.
    trace = make_trace(args, args.calib_n, args.seed + 1000)
    weights = load.parse_weighted(args.resolutions)
    lo = min(weights.values())
    cycle = [
        name
        for name in sorted(weights, key=lambda r: load.parse_resolution(r)[0] * load.parse_resolution(r)[1])
        for _ in range(max(1, round(weights[name] / lo)))
    ]
    for i, img in enumerate(trace.images):
        img.width, img.height = load.parse_resolution(cycle[i % len(cycle)])
    images = prepare_images(trace)
    port = free_port()
    argv = vlmserve_argv(model, port, server_extra(args, "fixed"))
    mode = load.LoadMode(concurrency=args.calib_clients, request_timeout_s=args.request_timeout_s)
    with ServerProcess("vlmserve calibration", argv, port, LOG_DIR / "calibration.log") as server:
        server.start(args.startup_timeout_s)
        with CpuMeter(server.pgid) as meter:
            res, s, _ = asyncio.run(
                measured_run(
                    server.base_url, trace, images, mode, args.warmup, args.slo_ttft_ms, args.slo_tpot_ms
                )
            )
    print(load.format_summary(s, f"calibration, fixed budget ({mode.label()})"), flush=True)
    if s["ok"] == 0:
        raise SystemExit("calibration: no request succeeded; see " + str(LOG_DIR / "calibration.log"))
    return {
        "argv": argv,
        "mode": mode.label(),
        "requests": len(trace.requests),
        "trace_digest": trace.digest(),
        "sustainable_rate": s["request_throughput"],
        "summary": s,
        "cpu": meter.result,
    }


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
            f"| {name} | {s['ok']}/{s['sent']} | {v['shed']} | {_fmt(v['shed_latency_ms']['p99'], '.0f')} "
            f"| {v['other_failures']} | {_fmt(s['goodput'], '.4f')} | {s['slo']['met']}/{s['sent']} "
            f"| {s['request_throughput']:.4f} | {_fmt(s['ttft_ms']['p50'], '.0f')} | {_fmt(s['ttft_ms']['p99'], '.0f')} "
            f"| {_fmt(s['tpot_ms']['p50'], '.1f')} | {_fmt(s['visual_tokens_per_image']['mean'], '.0f')} | {levels} |"
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


def main_run(args: argparse.Namespace) -> int:
    model = ensure_checkpoint(args.preset, args.checkpoint_seed, args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    calib = None
    sustainable = args.sustainable_rate
    if args.rate is None and sustainable is None:
        calib = calibrate(args, model)
        sustainable = calib["sustainable_rate"]
        print(f"sustainable rate at full resolution: {sustainable:.4f} req/s", flush=True)
    rate = args.rate if args.rate is not None else args.overload_factor * sustainable
    trace = make_trace(args, args.num_requests, args.seed)
    images = prepare_images(trace)
    load.save_trace(trace, out_dir / "trace.json")
    mode = load.LoadMode(rate=rate, request_timeout_s=args.request_timeout_s)
    print(
        f"offered rate {rate:.4f} req/s ({len(trace.requests)} requests over "
        f"~{trace.requests[-1].t_unit / rate:.0f} s of arrivals)",
        file=sys.stderr,
        flush=True,
    )

    runs: dict[str, dict] = {}
    results, summaries, recs = [], [], {}
    for budget in args.budgets:
        port = free_port()
        argv = vlmserve_argv(model, port, server_extra(args, budget))
        with ServerProcess(f"vlmserve {budget}", argv, port, LOG_DIR / f"{budget}.log") as server:
            server.start(args.startup_timeout_s)
            with CpuMeter(server.pgid) as meter:
                res, s, samples = asyncio.run(
                    measured_run(
                        server.base_url, trace, images, mode, args.warmup, args.slo_ttft_ms, args.slo_tpot_ms
                    )
                )
            after = asyncio.run(settled_metrics(server.base_url))
        shed = [r for r in res.records if r.status == 503 and r.error_kind == "http"]
        other = [r for r in res.records if not r.ok and r not in shed]
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
            f"  shed {v['shed']} (503 latency p99 {_fmt(v['shed_latency_ms']['p99'], '.0f')} ms), other failures "
            f"{v['other_failures']}, levels {v['levels']}, header {v['header_levels']}, highest level in "
            f"/metrics {v['max_level_seen_in_metrics']}; after: KV free {after['kv_blocks_free']:.0f}/"
            f"{after['kv_blocks_total']:.0f} → {'no leak' if after['no_leak'] else 'LEAK'}",
            flush=True,
        )
        print("  " + contention_note({budget: meter.result}), flush=True)
        runs[budget] = {
            "argv": argv,
            "startup_s": server.startup_s,
            "summary": s,
            "verdict": v,
            "metrics_after": after,
            "cpu": meter.result,
            "level_timeline": [[round(x[0], 3), *x[1:]] for x in samples],
        }
        named = NamedMode(budget, res.mode)
        named.rate = None  # both runs share one rate: no goodput-against-rate plot
        results.append(load.RunResult(named, res.records, res.planned, res.duration_s))
        summaries.append(s)
        recs[budget] = res.records

    ratio = ratio_met = None
    if "fixed" in runs and "adaptive" in runs:
        f, a = runs["fixed"]["summary"], runs["adaptive"]["summary"]
        ratio = a["goodput"] / f["goodput"] if f["goodput"] else (float("inf") if a["goodput"] else None)
        fm, am = f["slo"]["met"], a["slo"]["met"]
        ratio_met = am / fm if fm else (float("inf") if am else None)
    label = f"{args.preset} preset" if not args.model else str(model)
    if args.preset == "tiny" and not args.model:
        label += " (SMOKE RUN: tiny preset)"
    header = (
        f"checkpoint: {label}; {len(trace.requests)} requests, Poisson {rate:.4f} req/s = "
        f"{rate / sustainable if sustainable else float('nan'):.2f} × the sustainable {_fmt(sustainable, '.4f')} req/s"
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
        f"goodput adaptive / fixed: {_fmt(ratio)}× (requests meeting both SLOs: {_fmt(ratio_met)}×); target ≥ 2×: "
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
        "trace": {"digest": trace.digest(), "spec": trace.spec, "path": "trace.json"},
        "goodput_ratio": ratio,
        "met_ratio": ratio_met,
        "target": "goodput adaptive/fixed >= 2, no failure other than a fast 503",
        "contention": meters,
        "runs": runs,
    }
    (out_dir / "results.json").write_text(json.dumps(body, indent=1, default=float) + "\n")
    (out_dir / "records.json").write_text(
        json.dumps({k: [r.to_json() for r in v] for k, v in recs.items()}, default=float) + "\n"
    )
    load.write_plots(results, summaries, out_dir)
    plot_levels({k: v["level_timeline"] for k, v in runs.items()}, recs, out_dir / "levels.png")
    md = [
        "# Visual budget: adaptive against fixed under overload",
        "",
        f"`{body['command']}` — {body['created']}",
        "",
        header,
        "",
        table,
        "",
        ratio_line,
        "",
        contention_note(meters),
        "",
        f"Machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpus']} CPUs, {mach.get('mem_gib')} GiB, "
        f"no GPU; Python {mach['python']}, torch {mach.get('torch')}.",
        "",
        *[f"- {k}: `{' '.join(v['argv'])}`" for k, v in runs.items()],
        "",
        "Plots: `ttft_cdf.png`, `e2e_cdf.png`, `levels.png` (level and queue over time). Records: `records.json`.",
    ]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out_dir}/results.json, results.md, records.json, trace.json, *.png", file=sys.stderr)
    bad = any(v["verdict"]["other_failures"] or not v["metrics_after"]["no_leak"] for v in runs.values())
    return 1 if bad else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="visual_budget.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="24 requests, max_tokens 32, 12 calibration requests")
    add_common_args(p, requests="default 48; --quick 24", max_tokens="default 64; --quick 32")
    p.add_argument("--rate", type=float, help="offered rate (req/s); skips calibration")
    p.add_argument("--sustainable-rate", type=float, help="skip calibration: the full-resolution rate")
    p.add_argument("--overload-factor", type=float, default=2.0, help="offered = factor × sustainable")
    p.add_argument("--calib-n", type=int, help="calibration requests (default 24; --quick 12)")
    p.add_argument(
        "--calib-clients",
        type=int,
        default=8,
        help="calibration concurrency (closed loop; a short run at high concurrency ends in one bunched wave "
        "and underestimates the rate, so keep --calib-n at 3× this or more)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=500.0)
    p.add_argument(
        "--server-ttft-slo-ms", type=float, help="the server's --ttft-slo-ms (default: --slo-ttft-ms)"
    )
    p.add_argument(
        "--no-server-tpot",
        action="store_true",
        help="do not pass --slo-tpot-ms to the servers as --tpot-slo-ms (prefill beside decodes uncapped)",
    )
    p.add_argument("--max-queued-requests", type=int, help="passed to both servers")
    p.add_argument("--max-queued-tokens", type=int, help="passed to both servers")
    p.add_argument(
        "--budgets", default="fixed,adaptive", help="which runs, in order: fixed, fixed+admission, adaptive"
    )
    p.add_argument("--vlmserve-arg", action="append", default=[], help="extra `vlmserve serve` argument")
    p.add_argument("--out-dir", default=str(RESULTS_DIR / "visual_budget"))
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or (24 if args.quick else 48)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.calib_n = args.calib_n or (12 if args.quick else 24)
    args.server_ttft_slo_ms = args.server_ttft_slo_ms or args.slo_ttft_ms
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if bad := set(args.budgets) - set(BUDGETS):
        p.error(f"unknown budgets {sorted(bad)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    args = parse_args(argv)

    def on_term(signum, frame) -> None:  # SIGTERM: unwind like Ctrl-C, so the server is stopped
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        return main_run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: server stopped, nothing written for the unfinished run", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
