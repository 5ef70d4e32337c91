"""Streaming chats while large images encode: the encoder in the server process against ``--encoder-workers 1``.

One trace (``load.py``): Poisson arrivals, most requests text-only streaming chats, the rest one large image
(1344×1008 or 2048×1536). The same trace runs twice on a freshly started server (cold caches): once with the
encoder in-process, once with a local encoder pool of one process. Reported for both: request throughput,
p50/p99 TTFT of all requests, p50/p99 TPOT of the text-only streams (their decode steps are what a vision
batch in the server process stalls), failures, and the CPU share other processes took meanwhile. Target:
p99 TPOT with the pool ≤ 0.5× in-process, at ≤ 10 % throughput cost.

    .venv/bin/python benchmarks/encoder_tier.py                 # small preset, 48 requests
    .venv/bin/python benchmarks/encoder_tier.py -n 24 --rate 0.5 --max-tokens 24

Results go to ``benchmarks/results/encoder_tier/``; server logs to ``benchmarks/out/encoder_tier/``.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import functools
import json
import sys
from collections.abc import Sequence

from benchmarks import load
from benchmarks.harness import (
    OUT_DIR,
    RESULTS_DIR,
    ServerProcess,
    contention_note,
    ensure_checkpoint,
    fmt,
    free_port,
    machine,
    prepare_images,
    ratio,
    run_on,
    vlmserve_here_argv,
)

MODES = {"in-process": [], "encoder-workers-1": ["--encoder-workers", "1"]}


def make_trace(args: argparse.Namespace) -> load.Trace:
    share = args.image_share
    return load.make_trace(
        load.TraceSpec(
            num_requests=args.num_requests,
            seed=args.seed,
            resolutions=load.parse_weighted(args.resolutions),
            formats=load.parse_weighted("jpeg"),
            images_per_request={"0": 1.0 - share, "1": share},
            max_tokens=(args.max_tokens, args.max_tokens),
        )
    )


def figures(res: load.RunResult, trace: load.Trace) -> dict:
    ok = [r for r in res.records if r.ok]
    chats = [r for r in ok if not trace.requests[r.index].images]
    ttft = load._dist([r.ttft_s for r in ok if r.ttft_s is not None], 1e3)
    tpot = load._dist([r.tpot_s for r in chats if r.tpot_s is not None], 1e3)
    return {
        "ok": len(ok),
        "failed": len(res.records) - len(ok),
        "duration_s": res.duration_s,
        "throughput_rps": len(ok) / res.duration_s if res.duration_s else None,
        "ttft_ms": {"p50": ttft["p50"], "p99": ttft["p99"]},
        "chat_tpot_ms": {"p50": tpot["p50"], "p99": tpot["p99"]},
        "chats": len(chats),
    }


async def one_run(base_url: str, trace: load.Trace, images: load.ImageStore, rate: float) -> load.RunResult:
    v1 = base_url + "/v1"
    target = load.Target(v1, await load.discover_model(v1), ignore_eos=True)
    return await load.run_load(
        trace, images, target, load.LoadMode(rate=rate, request_timeout_s=600), progress_every_s=15.0
    )


def run(args: argparse.Namespace) -> int:
    model = ensure_checkpoint(args.preset, 0, args.model)
    trace = make_trace(args)
    images = prepare_images(trace)
    out = {"machine": machine(), "args": vars(args), "trace": trace.digest(), "runs": {}}
    for name, extra in MODES.items():
        port = free_port()
        argv = vlmserve_here_argv(model, port, ["--visual-budget", "fixed", *extra, *args.vlmserve_arg])
        server = ServerProcess(name, argv, port, OUT_DIR / "encoder_tier" / f"{name}.log")
        go = functools.partial(one_run, trace=trace, images=images, rate=args.rate)
        res, cpu, _ = run_on(server, 900, go, settle=False)
        out["runs"][name] = {"argv": argv, "figures": figures(res, trace), "cpu": cpu}
        print(name, json.dumps(out["runs"][name]["figures"]), flush=True)
    base, tier = (out["runs"][m]["figures"] for m in MODES)
    ratios = {
        "chat_tpot_p99": ratio(tier["chat_tpot_ms"]["p99"], base["chat_tpot_ms"]["p99"]),
        "chat_tpot_p50": ratio(tier["chat_tpot_ms"]["p50"], base["chat_tpot_ms"]["p50"]),
        "ttft_p99": ratio(tier["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
        "throughput": ratio(tier["throughput_rps"], base["throughput_rps"]),
    }
    out["ratios_pool_over_in_process"] = ratios
    print("pool / in-process: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in ratios.items()))
    print(contention_note({m: out["runs"][m]["cpu"] for m in MODES}))
    dest = RESULTS_DIR / "encoder_tier"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "results.json").write_text(json.dumps(out, indent=2, default=str))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--model", default=None, help="a checkpoint directory instead of the preset")
    p.add_argument("-n", "--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--image-share", type=float, default=0.25, help="share of requests carrying a large image")
    p.add_argument("--resolutions", default="1344x1008,2048x1536")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vlmserve-arg", action="append", default=[], help="extra `vlmserve serve` flag (repeat)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse_args()))
