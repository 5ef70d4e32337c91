"""The Qwen2-VL vision tower and merger, ours: patch embedding, 2-D rotary, varlen attention over packed
patches of many images (``cu_seqlens``), LayerNorm, MLP, and the 2×2 PatchMerger (the connector).

Parameter names are the checkpoint's (``visual.`` stripped), so loading is a name-for-name copy; the patch
embedding's Conv3d (kernel = stride = one patch) is the Linear it amounts to on flattened patches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from encoder.attention import Segments, VarlenAttention, cpu_kernel
from encoder.models.base import PatchGeometry, VisionTower

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@dataclass(frozen=True, slots=True)
class VisionConfig(PatchGeometry):
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
    rope_theta: float

    @classmethod
    def from_config(cls, config: dict) -> VisionConfig:
        """From a Qwen2-VL config.json (original or transformers-v5 layout)."""
        v = config.get("vision_config") or {}
        text = {**config, **(config.get("text_config") or {})}
        embed = int(v.get("embed_dim", 1280))
        rope = v.get("rope_parameters") or {}
        return cls(
            depth=int(v.get("depth", 32)),
            embed_dim=embed,
            num_heads=int(v.get("num_heads", 16)),
            mlp_hidden=int(embed * float(v.get("mlp_ratio", 4))),
            out_hidden=int(v.get("hidden_size") or text["hidden_size"]),
            hidden_act=str(v.get("hidden_act", "quick_gelu")),
            in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            spatial_merge_size=int(v.get("spatial_merge_size", 2)),
            rope_theta=float(rope.get("rope_theta", v.get("rope_theta", 10000.0))),
        )


@dataclass(slots=True)
class VisionBatch:
    """One tower pass's metadata, built once and read by every block: segments and rotary tables."""

    segments: Segments
    cos: torch.Tensor  # [N, head_dim / 2] float32
    sin: torch.Tensor


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(h, w) of every patch ([N, 2]), in the processor's order: merge×merge blocks, row-major within."""
    out = []
    for t, h, w in grid_thw:
        hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        hw = torch.stack([hh.transpose(1, 2).reshape(-1), ww.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2-D rotary: the first half of each head's frequencies read h, the second w ([N, head_dim/2]),
    computed on ``device`` (default: the positions'): on a GPU only the integer positions cross over, and the
    host is not the tower's bottleneck (the tables' cos and sin were 13 of a 43 ms Qwen2-VL pass on an H200)."""
    spatial = head_dim // 2
    positions = positions.to(device) if device is not None else positions
    steps = torch.arange(0, spatial, 2, dtype=torch.float, device=positions.device)
    inv_freq = 1.0 / (theta ** (steps / spatial))
    freqs = (positions.float().unsqueeze(-1) * inv_freq).flatten(1)  # [N, 2 · head_dim/4]
    return freqs.cos(), freqs.sin()


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, batch: VisionBatch, attend: VarlenAttention) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        return self.proj(attend(qkv, batch.cos, batch.sin, batch.segments, self.head_dim**-0.5))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act_name = act
        self.act = ACTIVATIONS[act]

    def use_kernels(self, lib) -> None:
        """With the compiled CPU kernels: quick_gelu in place, one pass over fc1's output instead of three; in
        bfloat16, Qwen3-VL's gelu-tanh in place too. NOTE: torch's bf16 gelu-tanh over a 1024² image's 4,096 ×
        4,304 fc1 output took 35.6 ms, 27 times a pass: about a quarter of the Qwen3-VL-2B tower (2-vCPU Xeon with
        AMX); float32 keeps torch's op, to the bit as the equivalence suite compares it."""
        if self.act_name == "quick_gelu":
            self.act = partial(cpu_kernel.bias_quick_gelu_, lib, bias=None)
        elif self.act_name == "gelu_pytorch_tanh":
            torch_act = self.act
            self.act = lambda x: (
                cpu_kernel.gelu_tanh_(lib, x)
                if x.dtype == torch.bfloat16 and x.is_contiguous()
                else torch_act(x)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm; in bfloat16 on the compiled CPU kernels, one pass (and :func:`add_norm`: a block's
    residual add and this norm in one). NOTE: torch's bfloat16 LayerNorm and add over a 1024² image's 5,476 ×
    1,280 patches took 7.9 and 6.5 ms, the kernel both in 8.0 (2-vCPU Xeon with AMX, best of 10); float32 keeps
    torch's ops, to the bit as the equivalence suite compares them. The kernel's mean and variance are summed in
    another order than torch's: the last bit differs for about 1 element in 30,000."""

    lib = None

    def use_kernels(self, lib) -> None:
        self.lib = lib

    def _kernel(self, x: torch.Tensor) -> bool:
        return (
            self.lib is not None
            and x.dtype == torch.bfloat16 == self.weight.dtype
            and x.device.type == "cpu"
            and self.bias is not None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel(x):
            return cpu_kernel.layer_norm(self.lib, x, self.weight.detach(), self.bias.detach(), self.eps)
        return super().forward(x)


def layer_norm(dim: int) -> nn.Module:
    return LayerNorm(dim, eps=1e-6)


def add_norm(norm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + y, norm(x + y))``: one kernel call where ``norm`` is a :class:`LayerNorm` on the kernels."""
    if isinstance(norm, LayerNorm) and norm._kernel(x) and y.shape == x.shape and y.dtype == x.dtype:
        return cpu_kernel.layer_norm(
            norm.lib, x, norm.weight.detach(), norm.bias.detach(), norm.eps, residual=y
        )
    total = x + y
    return total, norm(total)


class Block(nn.Module):
    """A block of every Qwen-VL tower: attention, then the MLP, each after its norm and added to the stream. The
    families differ in the norm (LayerNorm; RMSNorm for Qwen2.5-VL) and the MLP (named as each checkpoint
    stores it), which they hand in."""

    def __init__(
        self, embed_dim: int, num_heads: int, mlp: nn.Module, norm: Callable[[int], nn.Module] = layer_norm
    ) -> None:
        super().__init__()
        self.norm1 = norm(embed_dim)
        self.norm2 = norm(embed_dim)
        self.attn = Attention(embed_dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, batch: VisionBatch, attend: VarlenAttention) -> torch.Tensor:
        x, h = add_norm(self.norm2, x, self.attn(self.norm1(x), batch, attend))
        return x + self.mlp(h)


class PatchMerger(nn.Module):
    """A norm, then each merge×merge block of patches (adjacent rows) concatenated → MLP → decoder width."""

    def __init__(
        self, embed_dim: int, out_hidden: int, merge: int, norm: type[nn.Module] = LayerNorm
    ) -> None:
        super().__init__()
        self.width = embed_dim * merge**2
        self.ln_q = norm(embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch) as the Linear it amounts to; Qwen3-VL's has a bias."""

    def __init__(self, patch_dim: int, embed_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, embed_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Qwen2VisionTower(VisionTower):
    """Patches of several images ([Σ patches, C·T·P·P]) + their grids → merged rows ([Σ patches / merge², out])."""

    def __init__(self, cfg: VisionConfig, attention: str = "auto") -> None:
        super().__init__(cfg, attention)
        self.patch_embed = PatchEmbed(cfg.patch_dim, cfg.embed_dim)
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.num_heads, Mlp(cfg.embed_dim, cfg.mlp_hidden, cfg.hidden_act))
            for _ in range(cfg.depth)
        )
        self.merger = PatchMerger(cfg.embed_dim, cfg.out_hidden, cfg.spatial_merge_size)

    def metadata(self, grid_thw: list[tuple[int, int, int]], device: torch.device) -> VisionBatch:
        # NOTE: one segment per frame, as transformers' cu_seqlens (each temporal slice attends alone).
        segments = Segments.of_lengths([h * w for t, h, w in grid_thw for _ in range(t)])
        cos, sin = rotary_tables(
            patch_positions(grid_thw, self.cfg.spatial_merge_size),
            self.cfg.head_dim,
            self.cfg.rope_theta,
            device,
        )
        return VisionBatch(segments, cos, sin)

    def encode_pass(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        attend = self.attend or self.select_attention()
        batch = self.metadata(grids_of(grid_thw), pixel_values.device)
        x = self.patch_embed(pixel_values.to(self.dtype))
        for block in self.blocks:
            x = block(x, batch, attend)
        return self.merger(x)


def grids_of(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
