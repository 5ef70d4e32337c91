"""The compute dtype: what a checkpoint's weights run in on this device, and the start-up timing that tells
whether this CPU runs half precision faster than float32 (kept per CPU and torch version in the probe cache)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def compute_dtype(requested: str, checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    """The compute dtype for ``requested`` (a name, or ``auto``). ``auto`` keeps the checkpoint's own, except that
    - a half-precision checkpoint runs in float32 on a CPU whose half-precision matmul is slower than
      float32 (no AMX/AVX512-BF16: on an AVX2-only CPU bfloat16 matmul measured ~100× slower); upcasting
      is lossless;
    - a float32 checkpoint runs in bfloat16 on CUDA (as vLLM does): float32 wastes the tensor cores and
      halves the KV cache."""
    if requested == "auto":
        half = checkpoint_dtype in (torch.bfloat16, torch.float16)
        on_cpu = device.startswith("cpu")
        if half and on_cpu and not cpu_matmul_is_fast(checkpoint_dtype):
            return torch.float32
        if checkpoint_dtype == torch.float32 and device.startswith("cuda"):
            return torch.bfloat16
        return checkpoint_dtype
    if requested not in _DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[requested]


_FAST: dict[torch.dtype, bool] = {}


def cpu_matmul_is_fast(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` matmul on this CPU is at least as fast as float32 (timed once per process: a few ms
    where the dtype is native, ~0.1 s where it is emulated).

    oneDNN runs bfloat16 at several times the float32 rate where the CPU has AMX or AVX512-BF16 and
    emulates it far below the float32 rate where it has neither; a short timing says which without
    guessing from CPU flags. The verdict is kept across processes per CPU and torch version
    (runtime/timing_cache.py)."""
    if dtype not in _FAST:
        from runtime.timing_cache import cached_probe

        args = {"dtype": str(dtype).removeprefix("torch."), "shape": list(PROBE_SHAPE)}
        _FAST[dtype] = bool(cached_probe("matmul_is_fast", args, lambda: probe_matmul(dtype)))
    return _FAST[dtype]


PROBE_SHAPE = (128, 1024, 512)  # rows × inner × columns: a prefill chunk's projection, not a toy


def matmul_ratio(
    dtype: torch.dtype, timer: Callable[[], float] = time.perf_counter, rounds: int = 3, shape=PROBE_SHAPE
) -> float:
    """How long a ``dtype`` matmul of ``shape`` takes against float32 on this CPU, best runs compared (timed
    as :func:`runtime.native.best_times` does: once untimed, then ``rounds`` times alternating)."""
    from runtime.native import best_times

    m, k, n = shape
    half, full = (
        (torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)),
        (torch.randn(m, k), torch.randn(k, n)),
    )
    best = best_times({"half": lambda: half[0] @ half[1], "full": lambda: full[0] @ full[1]}, rounds, timer)
    return best["half"] / best["full"]


def probe_matmul(dtype: torch.dtype, timer: Callable[[], float] = time.perf_counter) -> bool:
    """Whether ``dtype`` matmuls run at least about as fast as float32 here: within 10 % counts as fast.
    Native bfloat16 (AVX512-BF16, AMX) is 2–9× faster, emulated (AVX2 only) 30–100× slower, so the verdict
    sits far from the line wherever it matters."""
    return matmul_ratio(dtype, timer) <= 1.1
