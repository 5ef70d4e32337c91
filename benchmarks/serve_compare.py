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

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import load
from benchmarks.harness import (
    OUT_DIR,
    RESULTS_DIR,
    VENV_BIN,
    NamedMode,
    ServerProcess,
    add_common_args,
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
    ratio,
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

# ---------------------------------------------------------------- the peer


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


# ---------------------------------------------------------------- driving


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
            f"| {fmt(s['ttft_ms']['p50'], '.0f')} | {fmt(s['ttft_ms']['p99'], '.0f')} "
            f"| {fmt(s['tpot_ms']['p50'], '.1f')} | {fmt(s['e2e_ms']['p50'], '.0f')} "
            f"| {fmt(s['prompt_tokens_mean'], '.0f')} | {s['failed']} |"
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
            f"| {label} | {fmt(r)}× | {sign} {target:g}× | {'yes' if met else 'NO' if met is not None else '-'} |"
        )
    for key, label in (("output_token_throughput", "output token throughput"), ("e2e_p50", "p50 E2E")):
        lines.append(f"| {label} | {fmt(ratios.get(key))}× | | |")
    return "\n".join(lines)


def cpu_note(runs: dict[str, dict]) -> str:
    """Server CPU seconds per completed request: a contention-robust view of the same comparison."""
    per = {}
    for name, v in runs.items():
        ok, cpu = v["summary"]["ok"], v["cpu"].get("server_cpu_s")
        per[name] = cpu / ok if ok and cpu else None
    text = "server CPU seconds per completed request: " + ", ".join(
        f"{k} {fmt(x, '.2f')}" for k, x in per.items()
    )
    vals = list(per.values())
    if len(vals) == 2 and vals[0] and vals[1]:
        text += f" (vlmserve uses {vals[0] / vals[1]:.2f}× the CPU per request)"
    return text


# ---------------------------------------------------------------- the compare run


def prepare_run(args: argparse.Namespace) -> tuple[Path, load.Trace, load.ImageStore, Path]:
    """The checkpoint, the trace (saved beside the records, under benchmarks/out/) and its images."""
    model = ensure_checkpoint(args.preset, args.checkpoint_seed, args.model)
    trace = build_trace(args)
    images = prepare_images(trace)
    out_dir = Path(args.out_dir)
    bulk = bulk_dir(out_dir)
    bulk.mkdir(parents=True, exist_ok=True)
    load.save_trace(trace, bulk / "trace.json")
    return model, trace, images, out_dir


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
        go = functools.partial(
            drive,
            trace=trace,
            images=images,
            mode=mode,
            dialect=dialect,
            warmup=args.warmup,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
        )
        (res, s, served), cpu, after = run_on(server, args.startup_timeout_s, go, settle=name == "vlmserve")
        print(load.format_summary(s, f"{name} ({mode.label()})"), flush=True)
        if after is not None:
            print(
                f"  /metrics after: KV blocks free {after['kv_blocks_free']:.0f}/{after['kv_blocks_total']:.0f}, "
                f"running {after['running']:.0f}, waiting {after['waiting']:.0f} → "
                f"{'no leak' if after['no_leak'] else 'LEAK'}",
                flush=True,
            )
        print(f"  {contention_note({name: cpu})}", flush=True)
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
            "cpu": cpu,
            "records": [r.to_json() for r in res.records],
        }

    ratios = compare_ratios(runs)
    table = compare_table([(k, v["summary"]) for k, v in runs.items()], ratios)
    meters = {k: v["cpu"] for k, v in runs.items()}
    label = checkpoint_label(args, model)
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
        "trace": trace_entry(trace, out_dir),
        "ratios": ratios,
        "targets": {"request_throughput": ">= 4", "ttft_p50": "<= 0.5"},
        "failed": failed,
        "contention": meters,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "records"} for k, v in runs.items()},
    }
    md = [
        header,
        "",
        table,
        "",
        cpu_note(runs) + ".",
        "",
        contention_note(meters),
        "",
        machine_line(mach),
        "",
    ]
    md += server_notes(runs)
    md += [
        "",
        f"In `{bulk_dir(out_dir)}`: plots `ttft_cdf.png`, `e2e_cdf.png`, per-request records `records.json`, "
        "the trace `trace.json`.",
    ]
    bulk = write_results(
        out_dir, body, "vlmserve vs transformers serve", md, {k: v["records"] for k, v in runs.items()}
    )
    load.write_plots(results, summaries, bulk)
    leak = runs["vlmserve"]["metrics_after"] and not runs["vlmserve"]["metrics_after"]["no_leak"]
    return 1 if leak or any(failed.values()) else 0


def compare_ratios(runs: dict[str, dict]) -> dict:
    """vlmserve's figures over transformers serve's (none where transformers was skipped)."""
    ours = runs["vlmserve"]["summary"]
    theirs = runs.get("transformers serve", {}).get("summary")
    if theirs is None:
        return {}
    return {
        "request_throughput": ratio(ours["request_throughput"], theirs["request_throughput"]),
        "output_token_throughput": ratio(ours["output_token_throughput"], theirs["output_token_throughput"]),
        "ttft_p50": ratio(ours["ttft_ms"]["p50"], theirs["ttft_ms"]["p50"]),
        "e2e_p50": ratio(ours["e2e_ms"]["p50"], theirs["e2e_ms"]["p50"]),
    }


def server_notes(runs: dict[str, dict]) -> list[str]:
    """The results page's line per server: its command, start-up time and the KV pool after the run."""
    md = []
    for k, v in runs.items():
        md.append(f"- {k}: `{' '.join(v['argv'])}`" + (f" (env {v['env']})" if v["env"] else ""))
        md.append(f"  startup {v['startup_s']:.1f} s")
        if v["metrics_after"]:
            a = v["metrics_after"]
            md.append(
                f"  /metrics after the run: KV blocks free {a['kv_blocks_free']:.0f} / {a['kv_blocks_total']:.0f}, "
                f"running {a['running']:.0f}, waiting {a['waiting']:.0f} ({'no leak' if a['no_leak'] else 'LEAK'})"
            )
    return md


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

    async def go(base_url: str) -> tuple[dict, tuple]:
        before = await scrape(base_url)
        kw = {"warmup": args.warmup, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
        return before, await drive(base_url, trace, images, mode, **kw)

    (before, (res, s, _)), cpu, after = run_on(server, args.startup_timeout_s, go)
    print(load.format_summary(s, f"vlmserve overload ({mode.label()}, {' '.join(extra)})"), flush=True)
    refused, other = refusals(res.records)
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
        f"  503 latency ms: p50 {fmt(lat['p50'], '.1f')}, p99 {fmt(lat['p99'], '.1f')}, max {fmt(lat['max'], '.1f')} "
        f"(fast = p99 ≤ {args.fast_503_ms:g} ms: {'yes' if fast else 'NO'})",
        f"  served requests: TTFT p50 {fmt(s['ttft_ms']['p50'], '.0f')} ms, p99 {fmt(s['ttft_ms']['p99'], '.0f')} ms",
        f"  /metrics after: KV blocks free {after['kv_blocks_free']:.0f}/{after['kv_blocks_total']:.0f}, running "
        f"{after['running']:.0f}, waiting {after['waiting']:.0f}, requests {after['requests_by_status']} → "
        f"{'no leak' if after['no_leak'] else 'LEAK'}",
        f"  {'PASS' if passed else 'FAIL'}"
        + ("" if refused else " (nothing was shed: raise --rate or lower the bounds)"),
        "  " + contention_note({"overload": cpu}),
    ]
    print("\n".join(lines), flush=True)
    mach = machine()
    body = {
        **results_header("benchmarks/serve_compare.py --overload", args, model, mach),
        "argv": argv,
        "startup_s": server.startup_s,
        "trace": trace_entry(trace, out_dir),
        "verdict": verdict | {"pass": passed},
        "summary": s,
        "metrics_before": {k: v for k, v in before.items() if k.startswith("vlmserve_")},
        "metrics_after": after,
        "cpu": cpu,
    }
    label = checkpoint_label(args, model)
    md = [
        f"checkpoint: {label}; "
        f"`{' '.join(argv)}`; Poisson arrivals at {args.rate:g} req/s, {len(trace.requests)} requests, "
        f"max_tokens {args.max_tokens}, trace {trace.digest()[:12]}{' [QUICK]' if args.quick else ''}",
        "",
        "```",
        load.format_summary(s, f"vlmserve overload ({mode.label()})"),
        *lines,
        "```",
        "",
        machine_line(mach),
        "",
        f"In `{bulk_dir(out_dir)}`: plots, per-request records `records.json`, the trace `trace.json`.",
    ]
    bulk = write_results(
        out_dir, body, "vlmserve under overload (admission control)", md, [r.to_json() for r in res.records]
    )
    load.write_plots([res], [s], bulk)
    return 0 if passed else 1


# ---------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = arg_parser("serve_compare.py", __doc__)
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
    return run_main(lambda: run_overload(args) if args.overload else run_compare(args))


if __name__ == "__main__":
    sys.exit(main())
