"""What every vision tower shares: its attention choice and its weight loader."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from encoder.attention import KernelAttention, VarlenAttention, choose_attention
from runtime.weights import read_tensors


class PatchGeometry:
    """What every tower config derives from its fields (embed_dim, num_heads, in_channels, patch_size,
    temporal_patch_size): one attention head's width and one flattened patch's length."""

    __slots__ = ()

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def pass_groups(sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive images ([first, end) index ranges) whose patch counts sum to at most ``budget`` each; an
    image over the budget makes a pass alone. ``budget`` 0: one pass."""
    if budget <= 0 or not sizes:
        return [(0, len(sizes))]
    groups, first, rows = [], 0, 0
    for i, n in enumerate(sizes):
        if i > first and rows + n > budget:
            groups.append((first, i))
            first, rows = i, 0
        rows += n
    groups.append((first, len(sizes)))
    return groups


class VisionTower(nn.Module):
    """Contract: ``forward(pixel_values [Σ patches, C·T·P·P], grid_thw [images, 3])`` → the merged rows of
    every image, in order ([Σ patches / merge², out_dim], the tower's dtype); an image's rows do not depend
    on the other images in the batch. Parameter names are the checkpoint's with ``visual.`` stripped.

    A family with deepstack levels (``levels`` > 0) returns each row as the main embedding followed by every
    level's, concatenated: [rows, (1 + levels) · out_dim] is one image's whole embedding."""

    prefixes = ("visual.", "model.visual.")
    levels = 0  # deepstack levels after the main embedding in each row
    # NOTE: one pass runs every block over at most this many patches (a larger image alone): on a 2-core
    # AVX2 EPYC in float32, ten images of 256-4,920 patches took 19.1-22.7 s in one pass and 17.8-21.2 s in
    # passes of at most 4,096 (four alternating runs each): a pass's activations stay in cache. Not yet
    # measured where bf16 runs natively. 0: everything in one pass.
    rows_per_pass = 4096

    def __init__(self, cfg, attention: str = "auto") -> None:
        """``cfg``: the family's vision config (heads, head dim, merge size and the merger's output width are
        read from it); ``attention``: what :meth:`select_attention` chooses from."""
        super().__init__()
        self.cfg = cfg
        self.spatial_merge_size = cfg.spatial_merge_size
        self.out_dim = cfg.out_hidden
        self._attention = (attention, cfg.num_heads, cfg.head_dim)
        self.attend: VarlenAttention | None = None

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The batch's images in passes of consecutive images (:func:`pass_groups`), rows concatenated."""
        sizes = [int(t * h * w) for t, h, w in grid_thw.tolist()]
        groups = pass_groups(sizes, self.rows_per_pass)
        if len(groups) == 1:
            return self.encode_pass(pixel_values, grid_thw)
        out, row = [], 0
        for first, end in groups:
            rows = sum(sizes[first:end])
            out.append(self.encode_pass(pixel_values[row : row + rows], grid_thw[first:end]))
            row += rows
        return torch.cat(out)

    def encode_pass(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One packed pass over these images (the family's tower)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def select_attention(self) -> VarlenAttention:
        """The attention implementation for the tower's device and dtype (timed once, see choose_attention)."""
        name, heads, head_dim = self._attention
        w = next(self.parameters())
        self.attend = choose_attention(name, w.device, w.dtype, heads, head_dim)
        if isinstance(self.attend, KernelAttention):  # the compiled path: its fused elementwise ops too
            for module in self.modules():
                if hasattr(module, "use_kernels"):
                    module.use_kernels(self.attend.lib)
        return self.attend

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        """Copy the checkpoint's ``visual.*`` tensors in (every parameter must be found, nothing left over)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in read_tensors(path, self.prefixes).items():
            key = name.removeprefix("model.").removeprefix("visual.")
            if key not in params:
                raise ValueError(f"unexpected vision tensor {name!r} in checkpoint {path}")
            param = params[key]
            if tensor.numel() != param.numel():
                raise ValueError(
                    f"vision tensor {name!r} in {path}: shape {tuple(tensor.shape)}, want {tuple(param.shape)}"
                )
            param.copy_(tensor.reshape(param.shape))
            loaded.add(key)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint {path} is missing vision tensors: {missing[:4]}")
