"""The compiled CPU paged decode attention kernel (``csrc/paged_decode.c``: float32 and bfloat16), loaded with
ctypes.

Built on first use by :mod:`runtime.native` (the system C compiler, cached on disk); without a
compiler, or with ``VLMSERVE_CPU_KERNELS=0``, :func:`load` returns ``None`` and the engine keeps the
torch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from runtime.native import load_library

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled paged decode library, or ``None`` (see :func:`load_library`)."""
    lib = load_library(_SOURCE, openmp=True)  # torch's OpenMP threads run the units (see the source)
    if lib is None:
        return None
    for fn in (lib.vlm_paged_decode_f32, lib.vlm_paged_decode_bf16):
        fn.restype = ctypes.c_int
        # q, k_cache, v_cache, tables, table_stride, lens, out, seqs, heads, kv_heads, head_dim, block, scale, threads
        fn.argtypes = [_PTR] * 4 + [_I64, _PTR, _PTR] + [_I64] * 5 + [ctypes.c_float, _I64]
    return lib


# The kernel's own limits (csrc/paged_decode.c); outside them callers use the torch path.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 64, 256, 256

# Below this much work (context tokens × KV heads) waking the pool's threads costs more than it saves.
_PARALLEL_MIN_WORK = 4096


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    h, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype
        and h % kvh == 0
        and h // kvh <= MAX_GROUP
        and d % 8 == 0
        and d <= MAX_HEAD_DIM
        and k_cache.shape[1] <= MAX_BLOCK
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int,
    num_threads: int | None = None,
    longest: int | None = None,
) -> torch.Tensor:
    """The compiled paged decode: same contract as ``torch_backend.paged_decode``, blocks read in place.

    ``num_threads`` defaults to torch's intra-op thread count, or 1 when the work is too small to share.
    ``longest``: ``context_lens.max()``, where the caller read it from this same tensor (a step's layers share
    one: :class:`~lm_engine.attention.torch_backend.CpuBackend` reads it once a step)."""
    s, h, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged decode needs contiguous KV caches")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    # NOTE: checked against the lengths themselves, not the caller's max_context: the kernel trusts every
    # length to stay inside its row of the table, and a wrong one would read outside it.
    if longest is None:
        longest = int(lens.max()) if s else 0
    if longest > tables.shape[1] * block_size:
        raise ValueError(f"context of {longest} tokens exceeds the block table ({tables.shape[1]} blocks)")
    out = torch.empty_like(q)
    work = max_context * s * kvh  # an upper bound of the tokens × KV heads read
    if num_threads is None:
        num_threads = torch.get_num_threads() if work >= _PARALLEL_MIN_WORK else 1
    decode = lib.vlm_paged_decode_bf16 if q.dtype == torch.bfloat16 else lib.vlm_paged_decode_f32
    rc = decode(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        out.data_ptr(),
        s,
        h,
        kvh,
        d,
        block_size,
        scale,
        max(1, int(num_threads)),
    )
    if rc != 0:
        raise ValueError(f"paged decode kernel refused its arguments (code {rc})")
    return out
