"""The Qwen2.5-VL vision tower and merger, ours: Qwen2-VL's patch embedding, rotary and attention, with
RMSNorm, a gated SiLU MLP, and window attention — patches reordered so that each window (window_size
pixels square, in merge units) is a contiguous segment, full attention over whole images only at
``fullatt_block_indexes``, and the merged rows put back in the image's order at the end."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from encoder.attention import Segments, cpu_kernel
from encoder.models.base import PatchGeometry, VisionTower
from encoder.models.qwen2_vl import (
    ACTIVATIONS,
    Block,
    PatchEmbed,
    PatchMerger,
    VisionBatch,
    grids_of,
    patch_positions,
    rotary_tables,
)
from runtime.linear import KernelLinear, silu_gated


@dataclass(frozen=True, slots=True)
class Qwen25VisionConfig(PatchGeometry):
    depth: int
    embed_dim: int
    num_heads: int
    intermediate_size: int
    out_hidden: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_config(cls, config: dict) -> Qwen25VisionConfig:
        """From a Qwen2.5-VL config.json (``vision_config.hidden_size`` is the tower's own width there)."""
        v = config.get("vision_config") or {}
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v.get("depth", 32)),
            embed_dim=int(v.get("hidden_size", 1280)),
            num_heads=int(v.get("num_heads", 16)),
            intermediate_size=int(v.get("intermediate_size", 3420)),
            out_hidden=int(v.get("out_hidden_size", 3584)),
            hidden_act=str(v.get("hidden_act", "silu")),
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            window_size=int(v.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.lib = None

    def use_kernels(self, lib) -> None:
        """With the compiled CPU kernels: one pass over x where torch makes seven. NOTE: with this and the gated
        MLP's fused silu · up, the small preset's tower on the benchmark's 10 images took 1.044 s against 1.205 s
        (bf16, a 2-vCPU Xeon, A/B in one process); a 30,000 × 384 norm 5.2 ms against 37.9."""
        self.lib = lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None and x.device.type == "cpu" and x.dtype == self.weight.dtype:
            return cpu_kernel.rms_norm(self.lib, x, self.weight.detach(), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act_name = act
        self.act = ACTIVATIONS[act]
        self.lib = None

    def use_kernels(self, lib) -> None:
        """With the compiled CPU kernels: silu(gate) · up in one pass over the two projections (torch: two)."""
        if self.act_name == "silu":
            self.lib = lib

    def one_pass(self) -> bool:
        """Whether gate, up and silu · up run as one call of the float32 kernel (gate_proj and up_proj are then
        never called): both projections on :class:`KernelLinear`."""
        return self.act_name == "silu" and type(self.gate_proj) is type(self.up_proj) is KernelLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_pass():
            # NOTE: the float32 kernel's gate, up and silu · up in one pass (the two [rows, 776] projections never
            # written): the small preset's MLP on 30,100 rows took 0.84-0.85x the time of the three calls, the
            # tower 6.34 against 6.70 s, same output to the bit (-march=znver3 build, 2026-12-04, benchmarks/README).
            return self.down_proj(silu_gated(self.gate_proj, self.up_proj, x))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.lib is not None and gate.device.type == "cpu":
            return self.down_proj(cpu_kernel.silu_mul(self.lib, gate, up))
        return self.down_proj(self.act(gate) * up)


def window_order(
    grid_thw: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """The merge units (merge×merge patch blocks) of all images reordered window by window, and each window's
    length in units. A window is ``window`` units square (fewer at the right and bottom edges), windows in
    row-major order per frame, units row-major within a window."""
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        units = torch.arange(t * gh * gw).view(t, gh, gw) + base
        for frame in units:
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    win = frame[top : top + window, left : left + window].reshape(-1)
                    order.append(win)
                    lengths.append(win.numel())
        base += t * gh * gw
    return torch.cat(order), lengths


class Qwen25VisionTower(VisionTower):
    """Patches of several images + their grids → merged rows, in the images' own order."""

    def __init__(self, cfg: Qwen25VisionConfig, attention: str = "auto") -> None:
        super().__init__(cfg, attention)
        self.patch_embed = PatchEmbed(cfg.patch_dim, cfg.embed_dim)
        self.blocks = nn.ModuleList(
            Block(
                cfg.embed_dim,
                cfg.num_heads,
                GatedMlp(cfg.embed_dim, cfg.intermediate_size, cfg.hidden_act),
                norm=RMSNorm,
            )
            for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg.embed_dim, cfg.out_hidden, cfg.spatial_merge_size, norm=RMSNorm)

    def metadata(
        self, grid_thw: list[tuple[int, int, int]], device: torch.device
    ) -> tuple[VisionBatch, VisionBatch, torch.Tensor]:
        """(full-attention batch, window batch, unit order); both batches hold the window-ordered rows."""
        cfg, unit = self.cfg, self.cfg.spatial_merge_size**2
        units, windows = window_order(
            grid_thw, cfg.spatial_merge_size, cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        )
        rows = (units.view(-1, 1) * unit + torch.arange(unit)).view(-1)
        cos, sin = rotary_tables(
            patch_positions(grid_thw, cfg.spatial_merge_size)[rows], cfg.head_dim, cfg.rope_theta, device
        )
        full = Segments.of_lengths([h * w for t, h, w in grid_thw for _ in range(t)])
        windowed = Segments.of_lengths([n * unit for n in windows])
        return VisionBatch(full, cos, sin), VisionBatch(windowed, cos, sin), units

    def encode_pass(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        attend = self.attend or self.select_attention()
        full, windowed, units = self.metadata(grids_of(grid_thw), pixel_values.device)
        unit = self.cfg.spatial_merge_size**2
        x = self.patch_embed(pixel_values.to(self.dtype))
        x = x.view(-1, unit, x.shape[-1])[units.to(x.device)].view(-1, x.shape[-1])
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.cfg.fullatt_block_indexes else windowed, attend)
        merged = self.merger(x)
        return merged[torch.argsort(units).to(merged.device)]
