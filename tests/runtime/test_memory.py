"""The oneDNN per-shape caches stay bounded once ``bound_native_caches`` ran (what serve, batch and the
offline ``LLM`` do).

bfloat16 matmuls on a CPU with AVX512-BF16 or AMX run through oneDNN, which PyTorch and oneDNN cache per
distinct shape (a primitive of ~0.65 MB each, 1,024 of them by default): 600 new token counts grew a fresh
process by ~400 MB. Where bf16 does not run through oneDNN nothing is cached and the bound holds trivially.
Each case runs in a fresh process: the capacities are read once, at the first primitive.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lm_engine.llm
from tests.support import REPO

CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
SCRIPT = """
import torch
from runtime.memory import bound_native_caches
bound_native_caches()

def rss_mb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Rss:")) / 1024

w = torch.randn(256, 256, dtype=torch.bfloat16)
with torch.no_grad():
    torch.nn.functional.linear(torch.randn(7, 256, dtype=torch.bfloat16), w)
    before = rss_mb()
    for m in range(100, 700):  # a new token count per call, as ragged prefill chunks give
        torch.nn.functional.linear(torch.randn(m, 256, dtype=torch.bfloat16), w)
print(rss_mb() - before)
"""


def test_new_matmul_shapes_do_not_grow_memory_without_bound():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # NOTE: no inherited cache settings
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mb = float(out.stdout.strip().splitlines()[-1])
    assert growth_mb < 100, f"600 bf16 matmul shapes grew the process by {growth_mb:.0f} MB"


@pytest.mark.parametrize("preset", [None, "64"], ids=["unset", "user-set"])
def test_the_offline_llm_bounds_the_caches_before_its_engine_runs(
    monkeypatch: pytest.MonkeyPatch, preset: str | None
) -> None:
    """``LLM`` applies the bound itself, before it builds the engine (whose warm-up runs the first matmuls),
    and keeps what the environment already says."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    if preset is not None:
        env["LRU_CACHE_CAPACITY"] = preset
    monkeypatch.setattr(os, "environ", env)  # the process's own environment stays as it is
    seen: dict[str, str | None] = {}

    class EngineThatRecords:
        def __init__(self, config: object) -> None:
            seen.update((name, os.environ.get(name)) for name in CACHE_VARIABLES)

    monkeypatch.setattr(lm_engine.llm, "LLMEngine", EngineThatRecords)
    lm_engine.llm.LLM("unused-checkpoint-dir")
    assert seen == {"LRU_CACHE_CAPACITY": preset or "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}


THP_SCRIPT = """
import resource, sys
import torch
from runtime.memory import huge_page_tensors
if sys.argv[1] == "on":
    huge_page_tensors()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):  # a fresh 64 MB mapping each time, as a prefill chunk's activations are
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4)
"""


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="the kernel grants no huge pages here")
def test_huge_page_tensors_cut_the_page_faults_of_large_buffers():
    """With the setting a fresh 64 MB buffer is faulted in 2 MB at a time (32 faults, not 16,384)."""
    faults = {}
    for mode in ("off", "on"):
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
        out = subprocess.run(
            [sys.executable, "-c", THP_SCRIPT, mode],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = float(out.stdout.strip().splitlines()[-1])
    if _thp_mode() == "madvise":
        assert faults["off"] > 8000, faults  # 4 KB pages: one fault each
    assert faults["on"] < 2000, faults


def test_huge_page_tensors_keep_what_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.memory import HUGE_PAGE_VARIABLE, huge_page_tensors

    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGE_VARIABLE}
    monkeypatch.setattr(os, "environ", env)
    assert huge_page_tensors() == "1" and env[HUGE_PAGE_VARIABLE] == "1"
    env[HUGE_PAGE_VARIABLE] = "0"  # a user who keeps 4 KB pages
    assert huge_page_tensors() == "0"
