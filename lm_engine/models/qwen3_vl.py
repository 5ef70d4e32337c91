"""Qwen3-VL's decoder, ours: Qwen3 layers (per-head q/k RMSNorm, an explicit head_dim) with interleaved M-RoPE,
and deepstack: the image's level rows are added to the hidden states after each of the first decoder layers, at
the image's token positions. The prompt rules (placeholders, M-RoPE positions of an image) are Qwen2-VL's.

An image's embedding rows arrive as [rows, (1 + levels) · hidden]: the main rows, which replace the placeholder
embeddings, then one block per level (see ``encoder/models/qwen3_vl.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from lm_engine.attention import AttentionBackend, AttentionMetadata
from lm_engine.models.qwen2_vl import (
    MRotaryEmbedding,
    Qwen2VLConfig,
    Qwen2VLDecoder,
    RMSNorm,
    _rotate_half,
    step_rotary,
)


@dataclass(slots=True)
class Qwen3VLConfig(Qwen2VLConfig):
    """Qwen2-VL's fields, read from Qwen3-VL's layout (text keys only under text_config, newer rope dict first,
    its defaults), plus an explicit head_dim, attention bias, interleaved rotary and the deepstack levels."""

    families: ClassVar[dict[str, str]] = {"qwen3_vl": "Qwen3VLForConditionalGeneration"}
    family_names: ClassVar[str] = "Qwen3-VL"
    default_rope_theta: ClassVar[float] = 5000000.0
    default_max_positions: ClassVar[int] = 128000

    # NOTE: field(): a bare annotation would take the base's head_dim property as its default
    head_dim: int = field(kw_only=True)
    attention_bias: bool = field(kw_only=True)
    mrope_interleaved: bool = field(kw_only=True)
    deepstack_levels: int = field(kw_only=True)

    @staticmethod
    def text_and_rope(raw: dict) -> tuple[dict, dict]:
        text = raw.get("text_config") or {}
        return text, text.get("rope_parameters") or text.get("rope_scaling") or {}

    @staticmethod
    def default_mrope_section(text: dict) -> list[int]:
        return [24, 20, 20]

    @staticmethod
    def own_fields(raw: dict, text: dict, rope: dict) -> dict:
        vision = raw.get("vision_config") or {}
        return {
            "head_dim": int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
            "attention_bias": bool(text.get("attention_bias", False)),
            "mrope_interleaved": bool(rope.get("mrope_interleaved", True)),
            "deepstack_levels": len(vision.get("deepstack_visual_indexes", (8, 16, 24))),
        }


class InterleavedMRotary(MRotaryEmbedding):
    """M-RoPE whose h and w bands interleave with t (t h w t h w …) instead of three contiguous sections:
    frequency j reads h when j ≡ 1 (mod 3) and j < 3·section[1], w when j ≡ 2 and j < 3·section[2], else t."""

    def __init__(self, head_dim: int, theta: float, section: list[int]) -> None:
        super().__init__(head_dim, theta, section)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
        self.axis = axis


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.lib = None

    def take_lib(self, lib) -> bool:
        if lib is None or self.q_norm.weight.device.type != "cpu":
            return False
        self.lib = lib
        return True

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        norms = (self.num_heads, self.q_norm.weight.detach(), self.k_norm.weight.detach(), self.q_norm.eps)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not step_rotary(self.lib, qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin, norms):
            q, k = self.q_norm(q), self.k_norm(k)
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * c + _rotate_half(q) * s
            k = k * c + _rotate_half(k) * s
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class Qwen3VLDecoder(Qwen2VLDecoder):
    """Flat ragged tokens ([T]), M-RoPE positions ([3, T]) and optional image rows with their levels: Qwen2-VL's
    decoder with q/k norms per head, interleaved rotary bands where the config says so, and the tower's
    deepstack levels added to the image rows after the first layers."""

    attention = Attention

    @staticmethod
    def make_rotary(cfg: Qwen3VLConfig) -> MRotaryEmbedding:
        rotary = InterleavedMRotary if cfg.mrope_interleaved else MRotaryEmbedding
        return rotary(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def place_images(
        self, x: torch.Tensor, mm_rows: torch.Tensor | None, mm_embeds: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """An image row carries the main merger's embedding, then each deepstack level's (the tower's layout):
        the main one goes in now, the levels after the first layers."""
        if mm_rows is None or not mm_rows.numel():
            return []
        main, *levels = mm_embeds.to(x.dtype).split(self.cfg.hidden_size, dim=-1)
        if len(levels) != self.cfg.deepstack_levels:
            raise ValueError(
                f"image rows carry {len(levels)} deepstack levels, the model has {self.cfg.deepstack_levels}"
            )
        x[mm_rows] = main
        return levels

    def layer_tensors(self) -> int:
        """q k v o gate up down, two norms, the q and k norms (and q/k/v/o biases where the config has them)."""
        return 11 + (4 if self.cfg.attention_bias else 0)
