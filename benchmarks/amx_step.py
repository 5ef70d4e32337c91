"""The AMX attention step taken apart (``csrc/amx_step.c``): nanoseconds per 16-row × 64-key step of the
varlen kernel's AMX path, whole and by part, on L1/L2-resident data, one thread.

    .venv/bin/python benchmarks/amx_step.py              # best of 300 passes per part
    .venv/bin/python benchmarks/amx_step.py --reps 1000

Which part of a step the time goes to, and whether the tile unit's work overlaps the vector units' (the
``products, then softmax`` row against the sum of ``products`` and ``softmax``). Where the CPU has no AMX
tiles it says so and exits. The bench is built from the kernel's source as it is in this checkout. Run it on a
quiet machine: tile and vector work on the other vCPU (a training run, a neighbour) made every part 2-4x
slower here.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import ctypes
import sys
from pathlib import Path

from runtime.native import load_library

ROOT = Path(__file__).resolve().parent.parent

KERNEL = ROOT / "runtime" / "csrc" / "cpu_kernel.c"
BENCH = Path(__file__).parent / "csrc" / "amx_step.c"
PARTS = {
    0: "whole step (amx_step)",
    1: "scores + their tile stores",
    2: "online softmax of the block",
    3: "P·V, accumulators loaded and stored",
    4: "16 tile products alone",
    5: "16 tile loads of k and v",
    6: "products (4), then softmax (2)",
    7: "16 products, one chained accumulator",
    8: "16 (tile load, product) pairs",
    9: "8 tile stores",
    10: "16 tile loads from L2 (1 MB of k, v)",
}


def build() -> ctypes.CDLL | None:
    """The kernel's source with the bench appended, as one file (its cache key covers both)."""
    out = ROOT / "benchmarks" / "out" / "amx_step"
    out.mkdir(parents=True, exist_ok=True)
    source = out / "amx_step_bench.c"
    source.write_text(f'#include "{KERNEL}"\n' + BENCH.read_text())  # its sections from beside it
    lib = load_library(source, openmp=True)
    if lib is not None:
        lib.vlm_amx_step_ns.restype = ctypes.c_double
        lib.vlm_amx_step_ns.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


def main() -> None:
    from benchmarks.encoder_throughput import cpu_flags

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args()
    print(f"CPU flags: {cpu_flags()}")
    lib = build()
    if lib is None:
        sys.exit("no C compiler: nothing to measure")
    ns = {part: lib.vlm_amx_step_ns(part, args.reps) for part in PARTS}
    if ns[0] < 0:
        sys.exit("no AMX tiles here (CPU, build or the kernel's grant): nothing to measure")
    for part, name in PARTS.items():
        print(f"{name:40s} {ns[part]:7.1f} ns")
    hidden = (ns[4] + ns[2] - ns[6]) / min(ns[4], ns[2])
    print(
        f"products + softmax measured apart: {ns[4] + ns[2]:.1f} ns; one after the other: {ns[6]:.1f} ns "
        f"({max(hidden, 0.0):.0%} of the shorter hidden behind the other)"
    )


if __name__ == "__main__":
    main()
