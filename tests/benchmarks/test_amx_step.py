"""benchmarks/amx_step.py builds the AMX attention step from the kernel's own source and runs every part of it.
Its build inlines ``amx_config`` into the bench, which is where a tile configuration loaded through GCC 12's
``_tile_loadconfig`` lost its column widths and ``ldtilecfg`` faulted: run in a subprocess, so a fault fails
this test instead of killing the test process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.amx_step import PARTS, ROOT
from runtime import cpu_kernel

LIB = cpu_kernel.load()
AMX = LIB is not None and cpu_kernel.amx_ready(LIB)


@pytest.mark.skipif(not AMX, reason="this CPU (or kernel) gives no AMX-BF16 tiles")
def test_every_part_of_the_step_runs():
    code = (
        "from benchmarks.amx_step import build, PARTS\n"
        "lib = build()\n"
        "print(' '.join(str(lib.vlm_amx_step_ns(p, 3)) for p in PARTS))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the bench died (code {proc.returncode}): {proc.stderr[-2000:]}"
    ns = [float(x) for x in proc.stdout.split()]
    assert len(ns) == len(PARTS)
    assert all(x > 0 for x in ns), ns  # -1 would mean no tiles after all
