"""Attention over packed varlen patches: each image (or window) attends within its own segment of the batch.

Two implementations of one contract (:class:`VarlenAttention`): plain torch (rotary + SDPA, one call per
segment length, the reference the kernel is tested against, and the CUDA path) and the compiled CPU kernel
(:mod:`runtime.cpu_kernel`: rotary fused into its packing, tiled, no score matrix materialised).
:func:`choose_attention` picks one by timing them on this machine, as ``resolve_dtype`` does for the dtype.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from runtime import cpu_kernel
from runtime.native import best_times
from runtime.timing_cache import cached_probe, library_tag

log = logging.getLogger("vlmserve.encoder")


@dataclass(slots=True)
class Segments:
    """Where each attention segment starts and ends in the packed batch (``bounds``: cu_seqlens as ints)."""

    bounds: list[int]
    cu_seqlens: torch.Tensor  # int32 on the CPU, the kernel's copy of ``bounds``
    _by_length: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of_lengths(cls, lengths: list[int]) -> Segments:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + int(n))
        return cls(bounds, torch.tensor(bounds, dtype=torch.int32))

    @property
    def longest(self) -> int:
        return max((b - a for a, b in zip(self.bounds, self.bounds[1:])), default=0)

    def by_length(self, device: torch.device) -> list[tuple[int, int, int | torch.Tensor]]:
        """The non-empty segments grouped by length, for one batched attention call per group: (length, count,
        where) with ``where`` the first row when the group's segments lie back to back, else the group's rows
        (a [count · length] index on ``device``). Built once per device; every block of a pass reuses it."""
        key = str(device)
        if key not in self._by_length:
            starts: dict[int, list[int]] = {}
            for a, b in zip(self.bounds, self.bounds[1:]):
                if b > a:
                    starts.setdefault(b - a, []).append(a)
            groups: list[tuple[int, int, int | torch.Tensor]] = []
            for length, first in starts.items():
                if first == list(range(first[0], first[0] + len(first) * length, length)):
                    groups.append((length, len(first), first[0]))
                else:
                    rows = (torch.tensor(first).view(-1, 1) + torch.arange(length)).view(-1)
                    groups.append((length, len(first), rows.to(device)))
            self._by_length[key] = groups
        return self._by_length[key]


class VarlenAttention:
    """Contract: ``qkv`` [N, 3, H, D] (the qkv projection's rows, compute dtype), ``cos``/``sin`` [N, D/2]
    float32 rotary tables of the axial (h, w) positions, ``segments`` over the N rows. Returns [N, H·D] in
    the compute dtype: rotary applied to q and k in float32 and rounded to the compute dtype (as transformers
    does), then softmax(q·kᵀ·scale)·v within each segment, the softmax in float32."""

    name = "base"

    def __call__(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments, scale: float
    ) -> torch.Tensor:
        raise NotImplementedError


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on [N, H, D] in float32, back in x's dtype; ``cos``/``sin`` [N, D/2] cover both halves."""
    c = torch.cat([cos, cos], dim=-1).unsqueeze(-2)
    s = torch.cat([sin, sin], dim=-1).unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


class TorchAttention(VarlenAttention):
    name = "torch"

    def __call__(self, qkv, cos, sin, segments, scale):
        # NOTE: segments of one length attend in one batched SDPA call: Qwen2.5-VL's window blocks are hundreds
        # of ≤ 64-patch windows, and a call each made its torch path launch-bound on a GPU (422 calls, 102 ms
        # of host time against 4.7 ms of device time for three images on an H200).
        n, _, h, d = qkv.shape
        q, k, v = qkv.unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = qkv.new_empty(n, h, d)
        for length, count, where in segments.by_length(qkv.device):
            if isinstance(where, int):
                rows = slice(where, where + count * length)
                seg = [t[rows].view(count, length, h, d).transpose(1, 2) for t in (q, k, v)]
                out[rows] = F.scaled_dot_product_attention(*seg, scale=scale).transpose(1, 2).flatten(0, 1)
            else:
                seg = [t.index_select(0, where).view(count, length, h, d).transpose(1, 2) for t in (q, k, v)]
                att = F.scaled_dot_product_attention(*seg, scale=scale)
                out.index_copy_(0, where, att.transpose(1, 2).flatten(0, 1))
        return out.view(n, h * d)


class KernelAttention(VarlenAttention):
    """The compiled kernel; ``amx``: its bfloat16 products on AMX tiles (where :func:`cpu_kernel.amx_ready`)."""

    def __init__(self, lib, amx: bool = False) -> None:
        self.lib = lib
        self.amx = amx
        self.name = "cpu-kernel-amx" if amx else "cpu-kernel"

    def __call__(self, qkv, cos, sin, segments, scale):
        return cpu_kernel.varlen_attention(self.lib, qkv, cos, sin, segments.cu_seqlens, scale, amx=self.amx)


_CHOICE: dict[tuple, str] = {}


def choose_attention(
    name: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int
) -> VarlenAttention:
    """``torch``, ``cpu-kernel`` or ``auto``: on the CPU the fastest of torch and the kernel's variants (its
    products on AMX tiles too, for bfloat16 where the CPU has them) on a 1024-patch image of this shape, timed
    once per CPU and torch version (a few ms; runtime/timing_cache.py); the torch path where the kernel does
    not apply. ``cpu-kernel`` times only the kernel's own variants."""
    if name not in ("auto", "torch", "cpu-kernel"):
        raise ValueError(f"vision attention must be auto, torch or cpu-kernel, got {name!r}")
    lib = cpu_kernel.load() if device.type == "cpu" else None
    usable = lib is not None and cpu_kernel.supports(dtype, head_dim)
    if name == "cpu-kernel" and not usable:
        raise ValueError(
            f"the CPU attention kernel does not apply here ({device}, {dtype}, head_dim {head_dim})"
        )
    if name == "torch" or not usable:
        return TorchAttention()
    candidates: list[VarlenAttention] = [] if name == "cpu-kernel" else [TorchAttention()]
    candidates.append(KernelAttention(lib))
    if dtype == torch.bfloat16 and cpu_kernel.amx_ready(lib):
        candidates.append(KernelAttention(lib, amx=True))
    if len(candidates) == 1:
        return candidates[0]
    key = (name, dtype, heads, head_dim)
    if key not in _CHOICE:
        args = {
            "candidates": [impl.name for impl in candidates],
            "dtype": str(dtype).removeprefix("torch."),
            "heads": heads,
            "head_dim": head_dim,
            "lib": library_tag(lib),
        }
        _CHOICE[key] = cached_probe(
            "vision_attention", args, lambda: _fastest(candidates, dtype, heads, head_dim)
        )
    return next(impl for impl in candidates if impl.name == _CHOICE[key])


def _fastest(candidates: list[VarlenAttention], dtype: torch.dtype, heads: int, head_dim: int) -> str:
    gen = torch.Generator().manual_seed(0)
    n = 1024
    qkv = torch.randn(n, 3, heads, head_dim, generator=gen).to(dtype)
    angle = torch.rand(n, head_dim // 2, generator=gen) * 6
    cos, sin = angle.cos(), angle.sin()
    segments = Segments.of_lengths([n])
    times = best_times(
        {impl.name: functools.partial(impl, qkv, cos, sin, segments, head_dim**-0.5) for impl in candidates}
    )
    pick = min(times, key=times.get)
    log.info(
        "vision attention: %s (%s, %d heads × %d; per 1024-patch image: %s)",
        pick,
        str(dtype).removeprefix("torch."),
        heads,
        head_dim,
        ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items()),
    )
    return pick
