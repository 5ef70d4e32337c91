"""The compiled CPU varlen attention kernel (``csrc/cpu_kernel.c``, its sections in ``csrc/cpu_kernel/``), loaded with ctypes.

Built on first use by :mod:`runtime.native` (the system C compiler, ``-march=native``, cached on disk);
without a compiler, or with ``VLMSERVE_CPU_KERNELS=0``, :func:`load` returns ``None`` and the tower keeps
the torch path. Built where the compiler targets AVX512-BF16, bfloat16 inputs run their two products as
bf16 dot products (``vdpbf16ps``), or as AMX tile products when the caller asks (``amx=True``, where
:func:`amx_ready`); elsewhere, and for float32, as float32 FMAs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from runtime.native import load_library

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernel.c"
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 256


@functools.cache
def load(march: str = "native") -> ctypes.CDLL | None:
    """The compiled library, or ``None`` (see :func:`runtime.native.load_library`)."""
    lib = load_library(_SOURCE, march, openmp=True)  # torch's OpenMP threads run it (see dispatch())
    if lib is None:
        return None
    fn = lib.vlm_varlen_attention
    fn.restype = ctypes.c_int
    # qkv, cos, sin, cu_seqlens, num_segments, out, rows, heads, head_dim, dtype, scale, threads, amx
    fn.argtypes = [_PTR] * 4 + [_I64, _PTR] + [_I64] * 4 + [ctypes.c_float, _I64, _I64]
    lib.vlm_varlen_attention_isa.restype = ctypes.c_char_p
    lib.vlm_amx_ready.restype = ctypes.c_int
    silu = lib.vlm_silu_mul
    silu.restype = ctypes.c_int
    # gate, up, out, rows, cols, row stride of gate and up, dtype, threads, pool
    silu.argtypes = [_PTR] * 3 + [_I64] * 6
    norm = lib.vlm_rms_norm
    norm.restype = ctypes.c_int
    # x, weight, out, rows, cols, eps, dtype, threads, pool
    norm.argtypes = [_PTR] * 3 + [_I64] * 2 + [ctypes.c_float, _I64, _I64, _I64]
    ln = lib.vlm_layer_norm
    ln.restype = ctypes.c_int
    # x, y, sum, weight, bias, out, rows, cols, eps, dtype, threads, pool
    ln.argtypes = [_PTR] * 6 + [_I64] * 2 + [ctypes.c_float] + [_I64] * 3
    rope = lib.vlm_rope_heads
    rope.restype = ctypes.c_int
    # x, cos, sin, q weight, k weight, rows, stride, heads, q heads, head dim, eps, threads, pool
    rope.argtypes = [_PTR] * 5 + [_I64] * 5 + [ctypes.c_float, _I64, _I64]
    act = lib.vlm_bias_quick_gelu
    act.restype = ctypes.c_int
    # x, bias, rows, cols, dtype, threads
    act.argtypes = [_PTR, _PTR] + [_I64] * 4
    gelu = lib.vlm_gelu_tanh
    gelu.restype = ctypes.c_int
    # x, rows, cols, dtype, threads
    gelu.argtypes = [_PTR] + [_I64] * 4
    causal = lib.vlm_causal_attention
    causal.restype = ctypes.c_int
    # q, k, v, out, lq, lk, heads, kv_heads, head_dim, q/k/v/out row strides, scale, threads, amx
    causal.argtypes = [_PTR] * 4 + [_I64] * 9 + [ctypes.c_float, _I64, _I64]
    lib.vlm_linear_packed_size.restype = _I64
    lib.vlm_linear_packed_size.argtypes = [_I64, _I64]
    lib.vlm_linear_pack.restype = ctypes.c_int
    # w, n, k, ldw, wp
    lib.vlm_linear_pack.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
    lib.vlm_linear.restype = ctypes.c_int
    # x, m, k, ldx, wp, n, bias, y, ldy, threads, pool
    lib.vlm_linear.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64]
    lib.vlm_linear_glu.restype = ctypes.c_int
    # x, m, k, ldx, gate wp, up wp, n, gate bias, up bias, y, ldy, threads, pool
    lib.vlm_linear_glu.argtypes = [
        _PTR,
        _I64,
        _I64,
        _I64,
        _PTR,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        _I64,
        _I64,
        _I64,
    ]
    return lib


@functools.cache  # asked on every prefill chunk (causal_supported): one ctypes call per library is enough
def isa(lib: ctypes.CDLL) -> str:
    """Which instructions run the products for bfloat16 inputs (``avx512-bf16`` or ``fp32-fma``)."""
    return lib.vlm_varlen_attention_isa().decode()


@functools.cache
def amx_ready(lib: ctypes.CDLL) -> bool:
    """Whether bfloat16 attention can run its products on AMX tiles here: the library was built for a CPU with
    AMX-BF16 and Linux granted this process the tile state (asked once)."""
    return bool(lib.vlm_amx_ready())


def _run(fn, name: str, *args) -> None:
    """One of the library's entry points; a nonzero return is its refusal code."""
    rc = fn(*args)
    if rc != 0:
        raise RuntimeError(f"{name} kernel failed (code {rc})")


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in _DTYPE_CODES and head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def varlen_attention(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    amx: bool = False,
) -> torch.Tensor:
    """``qkv`` [N, 3, H, D] → [N, H·D]: the :class:`encoder.attention.VarlenAttention` contract. ``amx``:
    bfloat16 products on AMX tiles (only where :func:`amx_ready`)."""
    n, three, h, d = qkv.shape
    if three != 3 or not supports(qkv.dtype, d) or qkv.device.type != "cpu":
        raise ValueError(
            f"varlen attention kernel: unsupported qkv {tuple(qkv.shape)} {qkv.dtype} {qkv.device}"
        )
    qkv = qkv.contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    if int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to {n}")
    if cos is not None:
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        if cos.shape != (n, d // 2) or sin.shape != (n, d // 2):
            raise ValueError(f"rotary tables must be [{n}, {d // 2}]")
    out = qkv.new_empty(n, h * d)
    _run(
        lib.vlm_varlen_attention,
        "varlen attention",
        qkv.data_ptr(),
        cos.data_ptr() if cos is not None else None,
        sin.data_ptr() if sin is not None else None,
        cu.data_ptr(),
        cu.numel() - 1,
        out.data_ptr(),
        n,
        h,
        d,
        _DTYPE_CODES[qkv.dtype],
        scale,
        max(1, int(num_threads or torch.get_num_threads())),
        int(amx),
    )
    return out


def causal_supported(lib: ctypes.CDLL | None, q: torch.Tensor) -> bool:
    """Whether :func:`causal_attention` takes these queries ([Lq, H, D]): bfloat16 on the CPU, where the library
    was built with the bf16 dot products (elsewhere torch's attention is as fast)."""
    return (
        lib is not None
        and q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and supports(q.dtype, q.shape[-1])
        and isa(lib) == "avx512-bf16"
    )


def causal_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    num_threads: int | None = None,
    amx: bool = False,
) -> torch.Tensor:
    """A decoder's prefill chunk: ``q`` [Lq, H, D] ends the ``k``/``v`` [Lk, KVH, D] context (row i sees keys up
    to Lk - Lq + i); grouped-query heads (H a multiple of KVH). Returns [Lq, H, D], bfloat16 (see
    :func:`causal_supported`). ``amx``: the products on AMX tiles (only where :func:`amx_ready`)."""
    (lq, heads, d), (lk, kv_heads, dk) = q.shape, k.shape
    if (
        not causal_supported(lib, q)
        or k.shape != v.shape
        or dk != d
        or k.dtype != q.dtype
        or v.dtype != q.dtype
    ):
        raise ValueError(
            f"causal attention kernel: unsupported q {tuple(q.shape)} {q.dtype}, k/v {tuple(k.shape)}"
        )
    if lk < lq or heads % kv_heads:
        raise ValueError(f"causal attention: {lq} queries, {lk} keys, {heads} heads over {kv_heads} kv heads")
    # rows may be strided (views of a fused projection); the heads of a row must be packed
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous() for t in (q, k, v))
    out = q.new_empty(lq, heads, d)
    _run(
        lib.vlm_causal_attention,
        "causal attention",
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        lq,
        lk,
        heads,
        kv_heads,
        d,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        scale,
        max(1, int(num_threads or torch.get_num_threads())),
        int(amx),
    )
    return out


def bias_quick_gelu_(lib: ctypes.CDLL, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """In place: ``x = quick_gelu(x + bias)`` over the last dimension, computed in float32 and rounded once
    (one pass over memory instead of torch's bias copy, multiply, sigmoid and multiply)."""
    if x.dtype not in _DTYPE_CODES or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"bias_quick_gelu_: unsupported {x.dtype} {x.device} tensor")
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
        if bias.shape != (x.shape[-1],):
            raise ValueError(f"bias must be [{x.shape[-1]}]")
    cols = x.shape[-1]
    _run(
        lib.vlm_bias_quick_gelu,
        "bias_quick_gelu_",
        x.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        x.numel() // cols,
        cols,
        _DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    return x


def gelu_tanh_(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` in place on contiguous ``x`` (float32 inside, rounded once), on torch's
    thread count of the vision pool: Qwen3-VL's tower MLP. Written as y·sigmoid(2u), which does not cancel where
    torch's 0.5·y·(1 + tanh(u)) does: in bfloat16, 0.15 % of the outputs over 1e-3 differ from torch's by one
    step, and below that ours are the closer to float64 (tests/encoder/test_layer_norm.py)."""
    if x.dtype not in _DTYPE_CODES or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(
            f"gelu_tanh_: unsupported {x.dtype} {x.device} tensor (contiguous: {x.is_contiguous()})"
        )
    cols = x.shape[-1]
    threads = torch.get_num_threads()
    _run(
        lib.vlm_gelu_tanh, "gelu_tanh_", x.data_ptr(), x.numel() // cols, cols, _DTYPE_CODES[x.dtype], threads
    )
    return x


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    threads: int | None = None,
    pool: str = "vision",
) -> torch.Tensor:
    """``weight · round(x · rsqrt(mean(x²) + eps))`` over the last dimension, as the towers' RMSNorm computes it
    (float32 inside, the normalised row rounded to x's dtype before the weight), in one pass over x. On
    ``threads`` (default torch's) of ``pool`` (:data:`POOLS`); on one thread, or 16 rows or fewer, the call runs on
    the caller alone and never waits for another thread's call of the library."""
    if x.dtype not in _DTYPE_CODES or x.device.type != "cpu" or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: unsupported {x.dtype} {x.device} input, {weight.dtype} weight")
    cols = x.shape[-1]
    if weight.shape != (cols,):
        raise ValueError(f"weight must be [{cols}]")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    _run(
        lib.vlm_rms_norm,
        "rms_norm",
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // cols,
        cols,
        eps,
        _DTYPE_CODES[x.dtype],
        torch.get_num_threads() if threads is None else threads,
        POOLS[pool],
    )
    return out


def layer_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    threads: int | None = None,
    pool: str = "vision",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch's ``layer_norm(x)`` over the last dimension (float32 inside, rounded once), in one pass over x; with
    ``residual``, ``(s, layer_norm(s))`` for ``s = x + residual`` (rounded as torch's add), both new tensors: a
    tower block's residual add and its next norm in one call. On ``threads`` (default torch's) of ``pool``."""
    if (
        x.dtype not in _DTYPE_CODES
        or x.device.type != "cpu"
        or weight.dtype != x.dtype
        or bias.dtype != x.dtype
    ):
        raise ValueError(
            f"layer_norm: unsupported {x.dtype} {x.device} input, {weight.dtype}/{bias.dtype} affine"
        )
    cols = x.shape[-1]
    if weight.shape != (cols,) or bias.shape != (cols,):
        raise ValueError(f"layer_norm: weight and bias must be [{cols}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"layer_norm: residual {tuple(residual.shape)} {residual.dtype} does not match x")
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    out = torch.empty_like(x)
    if residual is not None:
        residual = residual.contiguous()
        total = torch.empty_like(x)
    _run(
        lib.vlm_layer_norm,
        "layer_norm",
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        None if residual is None else total.data_ptr(),
        weight.data_ptr(),
        bias.data_ptr(),
        out.data_ptr(),
        x.numel() // cols,
        cols,
        eps,
        _DTYPE_CODES[x.dtype],
        torch.get_num_threads() if threads is None else threads,
        POOLS[pool],
    )
    return out if residual is None else (total, out)


def silu_mul(
    lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, threads: int | None = None, pool: str = "vision"
) -> torch.Tensor:
    """``silu(gate) * up`` as torch computes it in the input dtype (silu rounded, then the product), one pass, on
    ``threads`` (default torch's) of ``pool``; on one, the caller alone, as :func:`rms_norm`."""
    if gate.dtype not in _DTYPE_CODES or gate.device.type != "cpu" or up.dtype != gate.dtype:
        raise ValueError(f"silu_mul: unsupported {gate.dtype}/{up.dtype} {gate.device} inputs")
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: shapes {tuple(gate.shape)} and {tuple(up.shape)} differ")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    cols = gate.shape[-1] if gate.dim() else 1  # row by row, as silu_mul_halves: the same bits for a row
    _silu(lib, gate, up, out, gate.numel() // max(cols, 1), cols, cols, threads, pool)
    return out


def silu_mul_halves(
    lib: ctypes.CDLL, gate_up: torch.Tensor, threads: int | None = None, pool: str = "vision"
) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate-up projection's output [..., 2·I] (gate the first half of each row, up
    the second), read in place: :func:`silu_mul` of ``gate_up.chunk(2, -1)`` without copying the halves."""
    if gate_up.dtype not in _DTYPE_CODES or gate_up.device.type != "cpu" or gate_up.shape[-1] % 2:
        raise ValueError(
            f"silu_mul_halves: unsupported {gate_up.dtype} {gate_up.device} {tuple(gate_up.shape)}"
        )
    gate_up = gate_up.reshape(-1, gate_up.shape[-1])
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, cols)
    _silu(lib, gate_up, gate_up[:, cols:], out, rows, cols, gate_up.stride(0), threads, pool)
    return out


def _silu(lib, gate, up, out, rows: int, cols: int, ld: int, threads: int | None, pool: str) -> None:
    _run(
        lib.vlm_silu_mul,
        "silu_mul",
        gate.data_ptr(),
        up.data_ptr(),
        out.data_ptr(),
        rows,
        cols,
        ld,
        _DTYPE_CODES[gate.dtype],
        torch.get_num_threads() if threads is None else threads,
        POOLS[pool],
    )


def rope_heads(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: tuple[int, torch.Tensor, torch.Tensor, float] | None = None,
    threads: int = 1,
    pool: str = "prefill",
) -> None:
    """In place on bfloat16 ``x`` [rows, width] (rows contiguous): its first ``heads`` heads of ``head_dim``
    become ``x·cos + rotate_half(x)·sin`` (``cos``/``sin`` [rows, head_dim]), each op rounded to bfloat16 as torch
    computes it; with ``norms`` = (q_heads, q_weight, k_weight, eps) each head is first RMS-normed with its
    weight, as :func:`rms_norm` computes it. One pass; on the calling thread alone (a decode step's few rows)
    unless ``threads`` of ``pool`` are asked for (a prefill chunk)."""
    rows, width = x.shape
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(f"rope_heads: unsupported {x.dtype} {x.device} input of strides {x.stride()}")
    if width < heads * head_dim:
        raise ValueError(f"rope_heads: {heads} heads of {head_dim} do not fit a row of {width}")
    if cos.shape != (rows, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"rope_heads: cos/sin must be [{rows}, {head_dim}], got {tuple(cos.shape)}")
    cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    q_heads, wq, wk, eps = norms if norms is not None else (0, None, None, 0.0)
    if norms is not None:
        if wq.shape != (head_dim,) or wk.shape != (head_dim,) or wq.dtype != x.dtype or wk.dtype != x.dtype:
            raise ValueError(f"rope_heads: norm weights must be bfloat16 [{head_dim}]")
        wq, wk = wq.contiguous(), wk.contiguous()
    _run(
        lib.vlm_rope_heads,
        "rope_heads",
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        None if wq is None else wq.data_ptr(),
        None if wk is None else wk.data_ptr(),
        rows,
        x.stride(0),
        heads,
        q_heads,
        head_dim,
        eps,
        threads,
        POOLS[pool],
    )


POOLS = {"vision": 0, "prefill": 1}  # the library's thread pools: the tower's and the decoder's own


def has_linear(lib: ctypes.CDLL | None) -> bool:
    """Whether this build runs float32 linear layers (:func:`pack_linear`, :func:`linear`): the AVX2 build."""
    return lib is not None and lib.vlm_linear_packed_size(16, 16) > 0


def pack_linear(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``[N, K]`` weight in the layout :func:`linear` reads (panels of 16 output columns)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(
            f"pack_linear: unsupported weight {tuple(weight.shape)} {weight.dtype} {weight.device}"
        )
    n, k = weight.shape
    weight = weight.detach().contiguous()
    packed = torch.empty(lib.vlm_linear_packed_size(n, k), dtype=torch.float32)
    _run(lib.vlm_linear_pack, "linear pack", weight.data_ptr(), n, k, k, packed.data_ptr())
    return packed


def unpack_linear(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """:func:`pack_linear`'s inverse: the ``[N, K]`` weight."""
    panels = (n + 15) // 16
    return packed.view(panels, k, 16).permute(0, 2, 1).reshape(panels * 16, k)[:n].contiguous()


def _linear_rows(name: str, x: torch.Tensor, n: int, k: int, packed, biases) -> tuple[torch.Tensor, int]:
    """x as [rows, k] rows the kernel reads in place (copied only where its last dimension is strided) and their
    stride; refuses what the kernel cannot take."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(
            f"{name}: unsupported input {tuple(x.shape)} {x.dtype} {x.device} for [{n}, {k}] weight"
        )
    if any(w.numel() != (n + 15) // 16 * 16 * k for w in packed):
        raise ValueError(f"{name}: a packed weight is not [{n}, {k}]")
    for bias in biases:
        if bias is not None and (
            bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()
        ):
            raise ValueError(f"{name}: bias must be a contiguous float32 [{n}]")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    return rows, rows.stride(0) if rows.shape[0] > 1 else k  # a single row's stride can be anything


def linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    pool: str = "vision",
) -> torch.Tensor:
    """``x · wᵀ + bias`` over x's last dimension (float32, CPU), w packed by :func:`pack_linear`."""
    k = x.shape[-1]
    rows, ldx = _linear_rows("linear", x, n, k, (packed,), (bias,))
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    _run(
        lib.vlm_linear,
        "linear",
        rows.data_ptr(),
        rows.shape[0],
        k,
        ldx,
        packed.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
        POOLS[pool],
    )
    return out.view(*x.shape[:-1], n)


def linear_glu(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    n: int,
    gate_bias: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    pool: str = "vision",
) -> torch.Tensor:
    """``silu(x · gateᵀ + gate_bias) · (x · upᵀ + up_bias)`` (float32, CPU), both weights packed by
    :func:`pack_linear`: a gated MLP's two projections and its activation in one pass, the two ``[rows, n]``
    projections never written out. Each projection is :func:`linear`'s to the bit; the product is
    :func:`silu_mul`'s vectors'."""
    k = x.shape[-1]
    rows, ldx = _linear_rows("linear_glu", x, n, k, (gate, up), (gate_bias, up_bias))
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    _run(
        lib.vlm_linear_glu,
        "linear_glu",
        rows.data_ptr(),
        rows.shape[0],
        k,
        ldx,
        gate.data_ptr(),
        up.data_ptr(),
        n,
        gate_bias.data_ptr() if gate_bias is not None else None,
        up_bias.data_ptr() if up_bias is not None else None,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
        POOLS[pool],
    )
    return out.view(*x.shape[:-1], n)
