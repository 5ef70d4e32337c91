#!/usr/bin/env bash
# Runs a command with vlmserve's kernels built for an AVX2-only CPU (Zen 3: AVX2 + FMA, no AVX-512) and
# torch's kernels held to AVX2, so that an AVX2 machine's float32 code paths can be measured on a newer CPU:
#
#   benchmarks/as_avx2.sh .venv/bin/python benchmarks/encoder_throughput.py --family qwen2_5_vl --dtype float32
#
# What it measures are A/B ratios of code paths, not an AVX2 machine's figures: a newer core runs AVX2 code
# at its own rate (its caches, its FMA pipes). The benchmarks name the emulation in what they print and write.
set -euo pipefail
# A library built for a target this CPU cannot run dies of SIGILL on its first call: refuse first.
flags=$(grep -m1 -E '^flags' /proc/cpuinfo 2>/dev/null || true)
for f in avx2 fma f16c; do
  [[ " $flags " == *" $f "* ]] || { echo "as_avx2.sh: this CPU lacks $f; it cannot run the AVX2 build" >&2; exit 2; }
done
export VLMSERVE_MARCH="${VLMSERVE_MARCH:-znver3}"  # runtime.native builds our kernels for it
export VLMSERVE_EMULATED_ISA="avx2 (built -march=$VLMSERVE_MARCH; torch held to AVX2)"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec "$@"
