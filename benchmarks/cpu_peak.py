"""This CPU's arithmetic peak, measured (``csrc/cpu_peak.c``): chains of one vector instruction in registers
per thread, nothing loaded or stored. No matmul or attention on this machine can go faster, so a tower's
best possible speed-up over another is the peak over the other's achieved rate.

    .venv/bin/python benchmarks/cpu_peak.py            # float32 FMA, bf16 dot-product and AMX peaks, 1 s each

Printed beside the torch matmul rate in the same dtype (the shape ``encoder_throughput.py`` measures), so the
fraction of the peak the library's matmul reaches is visible too.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import ctypes
import functools
from pathlib import Path

from runtime.native import load_library

_SOURCE = Path(__file__).parent / "csrc" / "cpu_peak.c"
KINDS = {"float32": 0, "bfloat16": 1, "amx-bf16": 2}


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_library(_SOURCE)
    if lib is not None:
        lib.vlm_peak_gflops.restype = ctypes.c_double
        lib.vlm_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_int]
    return lib


def peak_gflops(dtype: str, threads: int, seconds: float = 0.5) -> float | None:
    """GFLOP/s over ``threads`` threads: float32 FMAs, or for bfloat16 the faster of bf16 dot products
    (``vdpbf16ps``) and AMX tile products (``amx-bf16`` alone: only those); ``None`` where there is no
    compiler or this CPU lacks the instruction (bf16 without AVX512-BF16 or AMX)."""
    lib = _lib()
    if lib is None:
        return None
    kinds = [KINDS[dtype]] + ([KINDS["amx-bf16"]] if dtype == "bfloat16" else [])
    rate = max(lib.vlm_peak_gflops(kind, seconds, threads) for kind in kinds)
    return rate if rate > 0 else None


def main() -> None:
    import torch

    from benchmarks.encoder_throughput import cpu_flags, machine_rates

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU flags: {cpu_flags()}  threads {args.threads}")
    amx = peak_gflops("amx-bf16", args.threads, args.seconds)
    print(f"amx-bf16  peak {amx:.0f} GFLOP/s" if amx else "amx-bf16  peak: no AMX tiles here")
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        peak = peak_gflops(name, args.threads, args.seconds)
        if peak is None:
            # NOTE: no timing of torch's matmul either: without the instruction a bf16 matmul of this size
            # takes minutes (a scalar fallback, on one thread, on an AVX2-only EPYC)
            print(f"{name:9} peak: no such instruction here")
        else:
            mm = machine_rates(dtype, 4, 64, 5)["matmul_gflops"]
            print(
                f"{name:9} peak {peak:.0f} GFLOP/s; torch matmul {mm:.0f} GFLOP/s ({mm / peak:.0%} of the peak)"
            )


if __name__ == "__main__":
    main()
