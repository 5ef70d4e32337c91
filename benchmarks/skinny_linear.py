"""A decode step's linear layers at a published shape, on oneDNN's call and on the few-row kernel
(runtime/csrc/skinny_linear.c), against a plain read of the same bytes.

    .venv/bin/python benchmarks/skinny_linear.py --preset qwen2-vl-2b          # 3.1 GB of weights, ~1 min
    .venv/bin/python benchmarks/skinny_linear.py --preset qwen2.5-vl-7b --rows 1   # 15 GB: nothing else running

Every layer gets its own random weights (the decoder's qkv, o, gate+up and down projections, and the output
projection), so a step reads them from memory as serving does, not from cache. For each row count the three
ways run in alternating rounds (oneDNN, the kernel, ``torch.sum`` over the packed words as float32: the rate
this machine reads those bytes at), and the median and best of each are printed and written to
``results/skinny_linear/<time>.json`` with the CPU flags. On this project's 2-vCPU VMs the neighbours' load on
the memory moved single passes by 2-5x: compare rows of one run, and the best passes more than the medians.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.real_size import cpu_info
from runtime import linear as packing
from tools.qwen2_vl_make import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def decoder_shapes(preset: str) -> list[tuple[int, int, bool]]:
    """(out, in, bias) of every linear layer a decode step runs, in order, from the preset's dimensions."""
    p = PRESETS[preset]
    head_dim = p.hidden_size // p.num_heads
    qkv = (p.num_heads + 2 * p.num_kv_heads) * head_dim
    layer = [
        (qkv, p.hidden_size, True),
        (p.hidden_size, p.num_heads * head_dim, False),
        (2 * p.intermediate_size, p.hidden_size, False),
        (p.hidden_size, p.intermediate_size, False),
    ]
    return layer * p.num_layers + [(p.vocab_size, p.hidden_size, False)]


def build(shapes: list[tuple[int, int, bool]]) -> list[packing.PackedLinear]:
    layers = []
    for i, (n, k, bias) in enumerate(shapes):
        lin = nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
        nn.init.normal_(lin.weight, std=0.02)
        layers.append(packing.PackedLinear(lin))
        del lin
        if i % 16 == 0:
            print(f"  packed {i + 1}/{len(shapes)}", file=sys.stderr, flush=True)
    return layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2-vl-2b", choices=[p for p in PRESETS if "-vl-" in p])
    ap.add_argument("--rows", default="1,4,16", help="rows per call (decode streams), comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "skinny_linear")
    args = ap.parse_args()

    path, _ = packing.skinny_here()
    if not path or not packing.native_bf16():
        sys.exit("the few-row kernel does not apply on this machine (no AMX/AVX512-BF16, or oneDNN's layout)")
    shapes = decoder_shapes(args.preset)
    total = sum(n * k * 2 for n, k, _ in shapes)
    print(f"{args.preset}: {len(shapes)} linear layers, {total / 1e9:.2f} GB of bfloat16 weights", flush=True)
    # NOTE: the start-up probe's verdict aside (this measures what it decides): every layer whose layout the
    # kernel reads takes it
    packing.skinny_is_faster = lambda: True
    layers = build(shapes)
    taken = sum(bool(layer.skinny) for layer in layers)
    print(f"the kernel reads {taken} of {len(layers)} layers (path {path})", flush=True)
    words = [packing.packed_words(layer.packed) for layer in layers]

    def read() -> None:
        for w in words:
            w.view(torch.float32).sum()

    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.no_grad():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k, _ in shapes}}

            def onednn(xs=xs) -> None:
                for layer in layers:
                    torch.ops.mkldnn._linear_pointwise(
                        xs[layer.in_features], layer.packed, layer.bias, "none", [], ""
                    )

            def kernel(xs=xs) -> None:
                for layer in layers:
                    packing.skinny_linear(layer, xs[layer.in_features])

            ways = {"onednn": onednn, "kernel": kernel, "read": read}
            for fn in ways.values():
                fn()
            times = {name: [] for name in ways}
            for _ in range(args.rounds):
                for name, fn in ways.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            row = {"rows": rows}
            for name, ts in times.items():
                row[name] = {
                    "median_ms": statistics.median(ts) * 1e3,
                    "best_ms": min(ts) * 1e3,
                    "all_ms": [t * 1e3 for t in ts],
                    "best_gbs": total / min(ts) / 1e9,
                }
            results.append(row)
            print(
                f"rows {rows:2d}: "
                + " | ".join(
                    f"{name} median {row[name]['median_ms']:.1f} ms, best {row[name]['best_ms']:.1f} ms"
                    f" ({row[name]['best_gbs']:.1f} GB/s)"
                    for name in ways
                ),
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / time.strftime("%Y%m%d-%H%M%S.json")
    out.write_text(
        json.dumps(
            {
                "preset": args.preset,
                "weight_bytes": total,
                "path": path,
                "machine": cpu_info(),
                "threads": torch.get_num_threads(),
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
