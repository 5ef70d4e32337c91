"""One-stream decode, vlmserve against llama.cpp's ``llama-server``, in alternating rounds on one machine.

``real_size.py`` runs the two servers one after the other, minutes apart; on this project's VMs the memory's read
rate swings by up to 1.5x within minutes (35 and 54 GB/s in one run of it, 2026-12-06), and a memory-bound decode
step swings with it, so a one-stream ratio from that run can say more about the hour than about the servers.
Here both servers are up at once (an idle server takes no CPU), and rounds alternate: vlmserve, llama.cpp, a read
of 1 GiB as float32 (``torch.sum``: the rate the step's floor is computed from), and again. Each round is one
greedy stream of ``--tokens`` tokens (``ignore_eos``) per server; its ms/token is the mean gap between tokens.
The ratio is taken per round (the two servers measured seconds apart), and its median over the rounds is quoted.

    .venv/bin/python benchmarks/decode_ab.py --model /work/ckpt/qwen2-vl-2b --rounds 6

JSON to ``benchmarks/results/real_size/<label>-ab-<YYYYMMDD-HHMM>.json``, a table on stdout, progress on stderr.
Both servers' memory must fit at once: the 2B shapes do on a 24 GiB machine (vlmserve's KV pool is faulted in as
used), the 7B shape does not.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness, llamacpp
from benchmarks import real_size as rs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--label", help="name of the result file (default: the checkpoint directory's name)")
    p.add_argument(
        "--vlmserve-arg", action="append", default=[], metavar="X", help="passed to vlmserve serve"
    )
    p.add_argument("--results-dir", type=Path, default=rs.RESULTS_DIR)
    p.add_argument("--log-dir", type=Path, default=rs.LOG_DIR)
    args = p.parse_args(argv)
    args.label = args.label or args.model.name
    return args


def one_stream(srv: rs.Server, prompt: str, tokens: int) -> dict:
    (stream,), wall = asyncio.run(srv.run([srv.body(prompt, tokens)]))
    gaps = stream.token_gaps_s()
    return {
        "ok": stream.ok,
        "tokens": stream.tokens,
        "ms_per_token": 1e3 * statistics.fmean(gaps) if gaps else None,
        "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "wall_s": wall,
        "error": stream.error,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    flags = rs.cpu_info()
    weights = rs.weight_bytes(args.model)
    floor_bytes = weights["floor_bytes"]
    bin_dir = llamacpp.ensure_built()
    gguf, _ = llamacpp.convert(args.model, outtype="bf16")

    port = harness.free_port()
    argv_v = harness.vlmserve_here_argv(args.model, port, args.vlmserve_arg)
    ours = harness.ServerProcess(
        "vlmserve", argv_v, port, args.log_dir / f"{args.label}-ab-{stamp}-vlmserve.log"
    )
    # text only: the peer's vision projector is not needed for a decode comparison
    peer = llamacpp.LlamaServer(
        gguf,
        None,
        ctx=4096,
        slots=1,
        bin_dir=bin_dir,
        log_path=args.log_dir / f"{args.label}-ab-{stamp}-llama.log",
    )
    rounds = []
    try:
        ours.start(timeout_s=900, poll_s=0.05)
        peer.start()
        servers = {
            "vlmserve": rs.Server(
                "vlmserve", ours.base_url, rs._model_id(ours.base_url), {"return_token_ids": True}
            ),
            "llama.cpp": rs.Server(
                "llama.cpp", peer.base_url, rs._model_id(peer.base_url), {"timings_per_token": True}
            ),
        }
        for srv in servers.values():  # warm-up: the first request of each pays for lazy initialisation
            one_stream(srv, rs.decode_prompt(-1), 8)
        for r in range(args.rounds):
            row = {"round": r}
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]  # neither always goes first
            for name in order:
                row[name] = one_stream(servers[name], rs.decode_prompt(r), args.tokens)
            row["read_gbs"] = rs.read_bandwidth(1 << 30, 3)["gbs"]
            row["floor_ms"] = rs.floor_ms(floor_bytes, row["read_gbs"])
            for name in servers:
                ms = row[name]["ms_per_token"]
                row[name]["over_floor"] = ms / row["floor_ms"] if ms and row["floor_ms"] else None
            a, b = row["vlmserve"]["ms_per_token"], row["llama.cpp"]["ms_per_token"]
            row["ratio"] = a / b if a and b else None
            rounds.append(row)
            rs.progress(
                f"round {r}: vlmserve {a:.1f} ms/token, llama.cpp {b:.1f}, read {row['read_gbs']:.1f} GB/s "
                f"(floor {row['floor_ms']:.1f} ms)"
            )
    finally:
        peer.stop()
        ours.stop()

    def med(key, sub=None):
        vals = [(r[key][sub] if sub else r[key]) for r in rounds]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    summary = {
        "vlmserve_ms": med("vlmserve", "ms_per_token"),
        "llamacpp_ms": med("llama.cpp", "ms_per_token"),
        "ratio_median": med("ratio"),
        "floor_ms_median": med("floor_ms"),
        "vlmserve_over_floor": med("vlmserve", "over_floor"),
        "llamacpp_over_floor": med("llama.cpp", "over_floor"),
    }
    result = {
        "label": args.label,
        "model": str(args.model),
        "created": stamp,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpu_model": flags["cpu_model"], "flags": flags["flags"]},
        "decode_step_bytes": floor_bytes,
        "rounds": rounds,
        "summary": summary,
    }
    out = args.results_dir / f"{args.label}-ab-{stamp}.json"
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(report_lines(result)))
    print(f"result: {out}")
    return 0


def report_lines(result: dict) -> list[str]:
    """The table and the median line printed for a result (its rounds and summary)."""
    summary, fmt = result["summary"], harness.fmt
    machine = result["machine"]
    lines = [
        f"decode_ab: {result['label']}, CPU {machine['cpu_model']} ({' '.join(machine['flags'])})",
        "| round | vlmserve ms/token | llama.cpp ms/token | ratio | read GB/s | floor ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rounds"]:
        lines.append(
            f"| {r['round']} | {fmt(r['vlmserve']['ms_per_token'], '.1f')} | "
            f"{fmt(r['llama.cpp']['ms_per_token'], '.1f')} | {fmt(r['ratio'], '.3f')} | "
            f"{r['read_gbs']:.1f} | {fmt(r['floor_ms'], '.1f')} |"
        )
    lines.append(
        f"median: vlmserve {fmt(summary['vlmserve_ms'], '.1f')}, llama.cpp {fmt(summary['llamacpp_ms'], '.1f')}, "
        f"ratio {fmt(summary['ratio_median'], '.3f')}; ÷ floor {fmt(summary['vlmserve_over_floor'], '.2f')} "
        f"and {fmt(summary['llamacpp_over_floor'], '.2f')}"
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())
