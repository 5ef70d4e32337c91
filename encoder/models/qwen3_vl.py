"""The Qwen3-VL vision tower, ours: patch 16 with a biased patch embedding, a learned square table of position
embeddings resampled (bilinear, corners aligned) to each image's grid, the Qwen2-VL blocks' attention with a
GELU-tanh MLP, and deepstack: the outputs of the ``deepstack_visual_indexes`` blocks, each through a merger of
its own, go to the first decoder layers.

An image's embedding is every level: the tower returns, per merged token, the main merger's row followed by
each deepstack level's, concatenated along the feature axis ([rows, (1 + levels) · out]). Slicing rows (chunked
prefill, the cache, the encoder tier) therefore keeps every level consistent with the main rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from encoder.attention import Segments
from encoder.models.base import PatchGeometry, VisionTower
from encoder.models.qwen2_vl import (
    ACTIVATIONS,
    Block,
    LayerNorm,
    PatchEmbed,
    VisionBatch,
    grids_of,
    patch_positions,
    rotary_tables,
)


@dataclass(frozen=True, slots=True)
class Qwen3VisionConfig(PatchGeometry):
    depth: int
    embed_dim: int
    num_heads: int
    mlp_hidden: int
    out_hidden: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_config(cls, config: dict) -> Qwen3VisionConfig:
        v = config.get("vision_config") or {}
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v.get("depth", 27)),
            embed_dim=int(v.get("hidden_size", 1152)),
            num_heads=int(v.get("num_heads", 16)),
            mlp_hidden=int(v.get("intermediate_size", 4304)),
            out_hidden=int(v.get("out_hidden_size", 3584)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            in_channels=int(v.get("in_channels", 3)),
            patch_size=int(v.get("patch_size", 16)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
            deepstack_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a ``side``-long axis and their weights, per target ``index``."""
    src = index.float() * (side - 1) / (size - 1).clamp(min=1).float()
    floor = src.floor()
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid_thw: list[tuple[int, int, int]], merge: int, side: int) -> tuple[torch.Tensor, ...]:
    """Per patch (processor order): the 4 rows of the ``side``² table it interpolates and their weights."""
    hw = patch_positions(grid_thw, merge)
    sizes = torch.tensor([[h, w] for t, h, w in grid_thw for _ in range(t * h * w)]).view(-1, 2)
    h_taps, h_w = _axis_taps(hw[:, 0], sizes[:, 0], side)
    w_taps, w_w = _axis_taps(hw[:, 1], sizes[:, 1], side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    return index, (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Merger(nn.Module):
    """merge×merge adjacent patches → one decoder-width row. The main merger normalises each patch before
    concatenating; a deepstack merger (``postshuffle``) normalises the concatenation."""

    def __init__(self, cfg: Qwen3VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = LayerNorm(self.width if postshuffle else cfg.embed_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionTower(VisionTower):
    """Patches of several images + their grids → per merged token the main row and every deepstack level's,
    concatenated ([Σ patches / merge², (1 + levels) · out])."""

    def __init__(self, cfg: Qwen3VisionConfig, attention: str = "auto") -> None:
        super().__init__(cfg, attention)
        self.levels = len(cfg.deepstack_indexes)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(cfg.patch_dim, cfg.embed_dim, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, Mlp(cfg.embed_dim, cfg.mlp_hidden, cfg.hidden_act))
            for _ in range(cfg.depth)
        )
        self.merger = Merger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, postshuffle=True) for _ in range(self.levels))

    def metadata(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> VisionBatch:
        segments = Segments.of_lengths([h * w for t, h, w in grid_thw for _ in range(t)])
        cos, sin = rotary_tables(
            patch_positions(grid_thw, self.spatial_merge_size), self.cfg.head_dim, self.cfg.rope_theta, device
        )
        return VisionBatch(segments, cos, sin)

    def positions(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """The learned position table resampled to every patch ([N, embed], float32 as transformers sums it)."""
        index, weight = position_taps(grid_thw, self.spatial_merge_size, self.side)
        rows = self.pos_embed(index.to(device))
        return (rows * weight.to(device)[:, :, None]).sum(1)

    def encode_pass(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        attend = self.attend or self.select_attention()
        grids = grids_of(grid_thw)
        device = pixel_values.device
        batch = self.metadata(grids, device)
        x = self.patch_embed(pixel_values.to(self.dtype))
        x = x + self.positions(grids, device).to(x.dtype)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, batch, attend)
            if i in self.cfg.deepstack_indexes:
                levels.append(self.deepstack_merger_list[self.cfg.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *levels], dim=-1)
