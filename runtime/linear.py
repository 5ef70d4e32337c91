"""Linear layers whose weight is reordered once, not on every call: oneDNN's (CPU, bfloat16) and our compiled
float32 one (:class:`KernelLinear`, AVX2 machines).

torch's bfloat16 ``F.linear`` on a CPU hands oneDNN the weight in its plain layout, and oneDNN copies it into
its blocked layout inside every call: one more pass over the whole weight per call, which is most of a
decode step's matmul (a few rows against every weight). :class:`PackedLinear` holds the weight already
reordered (``torch.ops.mkldnn._reorder_linear_weight``, what torch's own compiler does for frozen CPU models)
and calls oneDNN's linear with the bias fused. Where oneDNN runs bfloat16 natively (AVX512-BF16, AMX), plain
and packed calls run the same kernels: the results are equal bit for bit (tested), only the copy is gone.

Measured on an AMD EPYC with AVX512-BF16, 2 threads, the small preset's decoder shapes (768 → 1024, 768,
4096, 8192; 2048 → 768): 8 rows 1.9× faster in all, 64 rows 1.3×, 512 and 2,048 rows 1.05× and 1.09×.

:func:`pack_linears` swaps a module's ``nn.Linear`` children for them where that applies (CPU, bfloat16,
oneDNN's native bf16, not switched off by ``VLMSERVE_PACKED_LINEAR=0``, and a one-time timing on this machine
finding the packed call faster). A packed module's ``state_dict`` still holds the plain weight (read back
from the packed one), so an embedding's fingerprint does not depend on the packing; its parameters do not
(load weights before packing).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from runtime import cpu_kernel
from runtime.native import best_times, load_library, switched_off
from runtime.timing_cache import cached_probe, library_tag

log = logging.getLogger("vlmserve.linear")


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward with the weight in oneDNN's blocked layout (bias fused into the call)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # NOTE: plain attributes, not parameters or buffers: .to() and load_state_dict cannot handle the
        # opaque oneDNN tensor, and the module is built after the weights are in (see the module doc).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the few-row kernel (skinny_linear.c) on the same buffer, where it applies to this weight's layout
        self.skinny = skinny_path(linear.weight, self.bias, self.packed)
        # the buffer never moves: its address is read once, not on every call
        self.address = int(torch.ops.mkldnn.data_ptr(self.packed)) if self.skinny else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny and x.dim() >= 2 and x.numel() <= SKINNY_ROWS * self.in_features and x.numel():
            return skinny_linear(self, x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.packed.to_dense()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class KernelLinear(nn.Module):
    """``nn.Linear``'s forward (float32, CPU) on the compiled library's own matrix kernel, the weight packed once
    into its panels (:func:`runtime.cpu_kernel.linear`): on an AVX2 machine, where torch's float32
    matmul is MKL's sgemm, measured 1.2-2.4x faster at 8-64 rows (decode steps) and 0.98-1.2x at 512-4,096 rows
    (2-vCPU Zen 3, 2 threads; benchmarks/README.md). Runs on the library's ``pool`` ("vision" or "prefill")
    so that the tower and the decoder, each on its own thread, never queue behind each other."""

    def __init__(self, linear: nn.Linear, lib, pool: str) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lib, self.pool = lib, pool
        # NOTE: plain attributes, as in PackedLinear: the module is built after the weights are in.
        self.packed = cpu_kernel.pack_linear(lib, linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernel.linear(self.lib, x, self.packed, self.out_features, self.bias, self.pool)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = cpu_kernel.unpack_linear(
            self.packed, self.out_features, self.in_features
        )
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def silu_gated(gate: KernelLinear, up: KernelLinear, x: torch.Tensor) -> torch.Tensor:
    """``silu(gate(x)) · up(x)`` in one pass of the library (:func:`runtime.cpu_kernel.linear_glu`):
    the two projections are never written out, and the product needs no pass of its own."""
    if (gate.lib, gate.pool, gate.out_features, gate.in_features) != (
        up.lib,
        up.pool,
        up.out_features,
        up.in_features,
    ):
        raise ValueError("silu_gated: the gate and up projections differ in library, pool or shape")
    return cpu_kernel.linear_glu(
        gate.lib, x, gate.packed, up.packed, gate.out_features, gate.bias, up.bias, gate.pool
    )


def silu_gated_halves(gate_up: KernelLinear, x: torch.Tensor) -> torch.Tensor:
    """``silu(g) · u`` where ``g, u = gate_up(x).chunk(2, -1)``, in one pass of the library: a decoder's merged
    ``[2I, K]`` gate and up projection, whose packed panels split at I when I is a multiple of 16
    (:func:`halves_split`)."""
    n, k = gate_up.out_features // 2, gate_up.in_features
    if not halves_split(gate_up):
        raise ValueError(f"silu_gated_halves: {gate_up.out_features} outputs do not split into panels of 16")
    at = n * k  # n // 16 panels of [k][16]
    bias = gate_up.bias
    return cpu_kernel.linear_glu(
        gate_up.lib,
        x,
        gate_up.packed[:at],
        gate_up.packed[at:],
        n,
        None if bias is None else bias[:n],
        None if bias is None else bias[n:],
        gate_up.pool,
    )


def halves_split(linear: nn.Module) -> bool:
    """Whether ``linear`` is a :class:`KernelLinear` whose two output halves are whole panels of 16 (the gate's
    and the up projection's, for :func:`silu_gated_halves`)."""
    return type(linear) is KernelLinear and linear.out_features % 32 == 0


def kernel_linear_lib(weight: torch.Tensor):
    """The compiled library where :class:`KernelLinear` applies to this weight on this machine (CPU, float32,
    the AVX2 build, not switched off by ``VLMSERVE_KERNEL_LINEAR=0``, and a one-time timing finding it faster than
    ``F.linear`` on balance), else ``None``."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or switched_off("VLMSERVE_KERNEL_LINEAR"):
        return None
    lib = cpu_kernel.load()
    if not cpu_kernel.has_linear(lib) or not kernel_linear_is_faster():
        return None
    return lib


@functools.cache
def kernel_linear_is_faster(rounds: int = 5) -> bool:
    """Timed once per machine and library build (the start-up probe cache), see :func:`_time_kernel_linear`."""
    lib = cpu_kernel.load()
    return bool(cached_probe("kernel_linear", {"lib": library_tag(lib)}, lambda: _time_kernel_linear(rounds)))


def _time_kernel_linear(rounds: int) -> bool:
    """:class:`KernelLinear` against ``F.linear`` (float32), 768 → 1024, at 16 rows (a decode step) and at 1,024
    (a prefill chunk, a tower's pass), timed once per process (best of ``rounds``, alternating; a few tens of
    milliseconds): faster on balance, the geometric mean of the two time ratios under 1.

    NOTE: "no slower at either" flipped from one process to the next on a Zen 3, where the 1,024-row ratio was
    0.94-1.08 in four processes (this VM's noise) and the 16-row one 0.47-0.64."""
    linear = nn.Linear(768, 1024)
    ours = KernelLinear(linear, cpu_kernel.load(), "vision")
    ratio = 1.0
    with torch.no_grad():
        for rows in (16, 1024):
            x = torch.randn(rows, 768)
            best = best_times({"plain": lambda x=x: linear(x), "kernel": lambda x=x: ours(x)}, rounds)
            log.info(
                "float32 linear, %d rows: torch %.0f us, kernel %.0f us",
                rows,
                best["plain"] * 1e6,
                best["kernel"] * 1e6,
            )
            ratio *= best["kernel"] / best["plain"]
    return ratio < 1.0


def native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 natively here (then ``F.linear`` and a packed call use the same kernels);
    elsewhere torch's bfloat16 matmul is its own fallback, and packing would change the results."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def packing_applies(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_linears` packs linear layers with this weight on this machine."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and not switched_off("VLMSERVE_PACKED_LINEAR")
        and native_bf16()
        and packed_is_faster()
    )


@functools.cache
def packed_is_faster(rows: int = 32, width: int = 1024, rounds: int = 5) -> bool:
    """Timed once per machine (the start-up probe cache), see :func:`_time_packed_linear`."""
    args = {"rows": rows, "width": width}
    return bool(cached_probe("packed_linear", args, lambda: _time_packed_linear(rows, width, rounds)))


def _time_packed_linear(rows: int, width: int, rounds: int) -> bool:
    """A packed bfloat16 linear against ``F.linear`` on ``rows`` × ``width`` → ``width``, timed once per process
    (best of ``rounds``, alternating; well under a millisecond a call where bfloat16 is native)."""
    x = torch.randn(rows, width).to(torch.bfloat16)
    linear = nn.Linear(width, width).to(torch.bfloat16)
    packed = PackedLinear(linear)
    calls = {"plain": lambda: F.linear(x, linear.weight, linear.bias), "packed": lambda: packed(x)}
    with torch.no_grad():
        best = best_times(calls, rounds)
    log.info(
        "bfloat16 linear, %d rows: plain %.0f us, packed %.0f us",
        rows,
        best["plain"] * 1e6,
        best["packed"] * 1e6,
    )
    return best["packed"] < best["plain"]


def pack_linears(module: nn.Module, pool: str = "vision") -> int:
    """Swap every ``nn.Linear`` under ``module`` for a :class:`PackedLinear` where :func:`packing_applies`
    (bfloat16) or a :class:`KernelLinear` on the library's ``pool`` where :func:`kernel_linear_lib` finds it
    (float32); returns how many were swapped (0: none, the module is unchanged)."""
    found = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    swapped = 0
    # NOTE: popped, not iterated: the list must not keep a swapped layer's plain weight alive, or packing a
    # model holds every weight twice at its end (a 7B decoder's 14 GB twice did not fit a 24 GiB machine).
    found.reverse()
    while found:
        parent, name, child = found.pop()
        if packing_applies(child.weight):
            setattr(parent, name, PackedLinear(child))
        elif (lib := kernel_linear_lib(child.weight)) is not None:
            setattr(parent, name, KernelLinear(child, lib, pool))
        else:
            continue
        del child
        swapped += 1
    return swapped


# ---------------------------------------------------------------- few rows on the packed buffer

SKINNY_ROWS = 16  # the most rows skinny_linear.c takes in one call (an AMX tile's rows)
SKINNY_PROBE_SHAPE = (8192, 8192)  # the weight :func:`_time_skinny` times the kernel on
_SKINNY_SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.c"
# skinny_linear.c's paths: AMX tiles on 32-output blocks, AVX512-BF16 dot products on 32- or 64-output blocks
_SKINNY_PATHS = {("amx", 32): 1, ("avx512-bf16", 32): 2, ("avx512-bf16", 64): 3}
SKINNY_BLOCKS = (32, 64)  # the layouts [n/B][k/2][B][2] oneDNN was seen to pack: 32 with AMX, 64 without


@functools.cache
def skinny_library() -> tuple[ctypes.CDLL, int] | None:
    """The few-row kernel and the instruction set it runs here (``"amx"`` or ``"avx512-bf16"`` dot products), or
    ``None``: no compiler, neither instruction set, or ``VLMSERVE_SKINNY_LINEAR=0``."""
    if switched_off("VLMSERVE_SKINNY_LINEAR"):
        return None
    lib = load_library(_SKINNY_SOURCE, openmp=True)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.vlm_skinny_linear.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, i64, i64]
    lib.vlm_skinny_linear.restype = ctypes.c_int
    if lib.vlm_skinny_amx_ready():
        return lib, "amx"
    if lib.vlm_skinny_bf16dot():
        return lib, "avx512-bf16"
    return None


def skinny_code(isa: str, block: int) -> int:
    """skinny_linear.c's path for a layout of ``block``-output blocks on ``isa``, or 0: none reads it (AMX tiles
    read only 32-output blocks; on another block an AMX machine runs the dot products)."""
    if isa == "amx" and block != 32:
        isa = "avx512-bf16"
    return _SKINNY_PATHS.get((isa, block), 0)


def skinny_here() -> tuple[int, int]:
    """The path the few-row kernel runs here and the block of oneDNN's layout it reads, or (0, 0) where none
    applies (no library, or a layout of another kind)."""
    found, block = skinny_library(), skinny_layout_block()
    path = skinny_code(found[1], block) if found is not None and block else 0
    return (path, block) if path else (0, 0)


def packed_words(packed: torch.Tensor) -> torch.Tensor | None:
    """The raw 16-bit words of a oneDNN-packed bfloat16 weight, as a flat int16 tensor sharing its memory (and
    holding ``packed`` alive), or ``None`` where this torch cannot say where they are."""
    try:
        nbytes = int(torch.ops.mkldnn._nbytes(packed))
        address = int(torch.ops.mkldnn.data_ptr(packed))
    except (AttributeError, RuntimeError):
        return None
    if nbytes <= 0 or nbytes % 2:
        return None
    words = torch.frombuffer((ctypes.c_int16 * (nbytes // 2)).from_address(address), dtype=torch.int16)
    words.packed = packed  # NOTE: the words are the packed tensor's memory: it must outlive them
    return words


def vnni_offsets(rows: torch.Tensor, cols: torch.Tensor, k: int, block: int = 32) -> torch.Tensor:
    """Where weight[rows, cols] lies in the layout [n/B][k/2][B][2], B = ``block`` (in 16-bit words)."""
    return (rows // block) * block * k + (cols // 2) * 2 * block + (rows % block) * 2 + cols % 2


def vnni_layout(
    weight: torch.Tensor, words: torch.Tensor | None, block: int = 32, samples: int = 4096
) -> bool:
    """Whether ``words`` (:func:`packed_words` of oneDNN's packing of ``weight``, [n, k] bfloat16) hold it as
    [n/B][k/2][B][2] (B = ``block``) with no padding: their size, and the words at both ends and at ``samples`` random places.
    (oneDNN picks its layout per ISA and shape; the kernel runs only on a weight whose layout was seen to be this
    one. A weight whose values repeat could pass with another layout; :func:`skinny_layout_checked` also packs a
    weight of distinct values once a process.)"""
    n, k = weight.shape
    if words is None or words.numel() != n * k:
        return False
    plain = weight.detach().contiguous().view(torch.int16)
    gen = torch.Generator().manual_seed(n * 131 + k)
    rows = torch.cat([torch.tensor([0, n - 1, n - 1, 0]), torch.randint(0, n, (samples,), generator=gen)])
    cols = torch.cat([torch.tensor([0, k - 1, 0, k - 1]), torch.randint(0, k, (samples,), generator=gen)])
    return bool(torch.equal(words[vnni_offsets(rows, cols, k, block)], plain[rows, cols]))


@functools.cache
def skinny_layout_block(n: int = 192, k: int = 160) -> int:
    """The block B of oneDNN's layout [n/B][k/2][B][2] here (one of :data:`SKINNY_BLOCKS`), or 0 for another
    layout: seen once a process on weights whose every entry tells its place apart (row and column in two
    weights of small integers, exact in bfloat16). :func:`vnni_layout` then samples each real weight."""
    rows = torch.arange(n).view(n, 1).expand(n, k)
    cols = torch.arange(k).view(1, k).expand(n, k)
    packed = []
    for index in (rows, cols):
        w = index.to(torch.bfloat16).contiguous()
        words = packed_words(torch.ops.mkldnn._reorder_linear_weight(w, None))
        if words is None or words.numel() != n * k:
            return 0
        packed.append((w.view(torch.int16).reshape(-1), words))
    r, c = rows.reshape(-1), cols.reshape(-1)
    for block in SKINNY_BLOCKS:
        offsets = vnni_offsets(r, c, k, block)
        if all(torch.equal(words[offsets], plain) for plain, words in packed):
            return block
    return 0


def skinny_path(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> int:
    """The path of skinny_linear.c that runs this packed weight's calls of up to :data:`SKINNY_ROWS` rows, or 0:
    the library, the shape (multiples of 32), the layout (:func:`vnni_layout`) and a one-time timing
    (:func:`skinny_is_faster`) must all allow it."""
    path, block = skinny_here()
    n, k = weight.shape
    if not path or n % block or k % 32 or (bias is not None and bias.dtype != torch.bfloat16):
        return 0
    if not (vnni_layout(weight, packed_words(packed), block) and skinny_is_faster()):
        return 0
    return path


def skinny_call(x: torch.Tensor, address: int, n: int, bias: torch.Tensor | None, path: int) -> torch.Tensor:
    """``x · wᵀ + bias`` on skinny_linear.c for ``x`` [..., k] bfloat16 of at most :data:`SKINNY_ROWS` rows, the
    weight [n, k] at ``address`` in the layout [n/B][k/2][B][2] that ``path`` reads (:func:`skinny_code`)."""
    lib, _ = skinny_library()
    k = x.shape[-1]
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1 or flat.stride(0) < k:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.bfloat16)
    rc = lib.vlm_skinny_linear(
        flat.data_ptr(),
        flat.shape[0],
        k,
        flat.stride(0),
        address,
        n,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        torch.get_num_threads(),
        path,
    )
    if rc != 0:
        raise RuntimeError(f"skinny_linear.c refused a {flat.shape[0]} × {k} → {n} call (path {path}): {rc}")
    return out.view(*x.shape[:-1], n)


def skinny_linear(linear: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for up to :data:`SKINNY_ROWS` rows on skinny_linear.c, reading the packed buffer once."""
    if x.dtype != torch.bfloat16 or x.shape[-1] != linear.in_features:
        return torch.ops.mkldnn._linear_pointwise(x, linear.packed, linear.bias, "none", [], "")
    return skinny_call(x, linear.address, linear.out_features, linear.bias, linear.skinny)


@functools.cache
def skinny_is_faster(rounds: int = 15) -> bool:
    """Timed once per machine and library build (the start-up probe cache), see :func:`_time_skinny`."""
    path, _ = skinny_here()
    if not path:
        return False
    args = {"lib": library_tag(skinny_library()[0]), "path": path, "weight": list(SKINNY_PROBE_SHAPE)}
    return bool(cached_probe("skinny_linear", args, lambda: _time_skinny(rounds)))


def _time_skinny(rounds: int) -> bool:
    """The few-row kernel against oneDNN's call on the same packed 8,192 × 8,192 weight (128 MB: a decode step
    reads its weights from memory, not from cache; at 16 MB both ran from L3 and the order of the two flipped
    between runs) at 1 and 16 rows, best of ``rounds``, alternating. Taken unless it is slower on balance by
    more than this VM's noise: the geometric mean of the two time ratios under 1.1. (On a 2-vCPU Xeon with AMX
    it ran at the rate of a plain read of the buffer, and a decode step's linears at the Qwen2-VL-2B shape took
    0.86-0.93 of oneDNN's time; but single calls of this probe's size took 2.7 to 22 ms for either, by the
    neighbours' load on the machine's memory, so only the best of many runs says anything.) About 1 s, once per
    machine."""
    n, k = SKINNY_PROBE_SHAPE
    weight = torch.randn(n, k).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    words = packed_words(packed)
    path, block = skinny_here()
    if not (path and vnni_layout(weight, words, block)):
        return False
    del weight
    address = words.data_ptr()
    ratio = 1.0
    with torch.no_grad():
        for rows in (1, 16):
            x = torch.randn(rows, k).to(torch.bfloat16)
            calls = {
                "onednn": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                "skinny": lambda x=x: skinny_call(x, address, n, None, path),
            }
            best = best_times(calls, rounds)
            log.info(
                "bfloat16 linear on the packed weight, %d rows: oneDNN %.0f us, few-row kernel %.0f us",
                rows,
                best["onednn"] * 1e6,
                best["skinny"] * 1e6,
            )
            ratio *= best["skinny"] / best["onednn"]
    return ratio < 1.1 * 1.1
