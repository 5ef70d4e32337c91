"""Attention over packed varlen patches: each image (or window) attends within its own segment of the batch.

The contract is :class:`VarlenAttention`; the plain-torch implementation runs rotary + SDPA per segment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(slots=True)
class Segments:
    """Where each attention segment starts and ends in the packed batch (``bounds``: cu_seqlens as ints)."""

    bounds: list[int]
    cu_seqlens: torch.Tensor  # int32 on the CPU, the kernel's copy of ``bounds``

    @classmethod
    def of_lengths(cls, lengths: list[int]) -> Segments:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + int(n))
        return cls(bounds, torch.tensor(bounds, dtype=torch.int32))

    @property
    def longest(self) -> int:
        return max((b - a for a, b in zip(self.bounds, self.bounds[1:])), default=0)


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
        n, _, h, d = qkv.shape
        q, k, v = qkv.unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = qkv.new_empty(n, h, d)
        bounds = segments.bounds
        for a, b in zip(bounds, bounds[1:]):
            if b > a:
                seg = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
                out[a:b] = F.scaled_dot_product_attention(*seg, scale=scale)[0].transpose(0, 1)
        return out.view(n, h * d)


def choose_attention(
    name: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int
) -> VarlenAttention:
    """``torch`` or ``auto`` (the torch path: the only one so far)."""
    if name not in ("auto", "torch"):
        raise ValueError(f"vision attention must be auto or torch, got {name!r}")
    return TorchAttention()
