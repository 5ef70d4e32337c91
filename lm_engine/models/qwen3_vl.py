"""Qwen3-VL's decoder, ours: Qwen3 layers (per-head q/k RMSNorm, an explicit head_dim) with interleaved M-RoPE,
and deepstack: the image's level rows are added to the hidden states after each of the first decoder layers, at
the image's token positions. The prompt rules (placeholders, M-RoPE positions of an image) are Qwen2-VL's.

An image's embedding rows arrive as [rows, (1 + levels) · hidden]: the main rows, which replace the placeholder
embeddings, then one block per level (see ``encoder/models/qwen3_vl.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from encoder.models import checkpoint_dtype, read_config
from lm_engine.attention import AttentionBackend, AttentionMetadata
from lm_engine.models.qwen2_vl import (
    MRotaryEmbedding,
    Qwen2VLDecoder,
    RMSNorm,
    _rotate_half,
    step_rotary,
)


@dataclass(slots=True)
class Qwen3VLConfig:
    """The fields the engine needs (those of ``Qwen2VLConfig``, plus head_dim, q/k norm and deepstack)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int]
    mrope_interleaved: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: list[int]
    deepstack_levels: int
    vision: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    @property
    def spatial_merge_size(self) -> int:
        return int(self.vision.get("spatial_merge_size", 2))

    @classmethod
    def from_dir(cls, path: str | Path) -> Qwen3VLConfig:
        path = Path(path)
        raw = read_config(path)
        text, vision = raw.get("text_config") or {}, raw.get("vision_config") or {}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
            attention_bias=bool(text.get("attention_bias", False)),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or text.get("rope_theta") or 5000000.0),
            mrope_section=list(rope.get("mrope_section") or [24, 20, 20]),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            max_position_embeddings=text.get("max_position_embeddings", 128000),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            dtype=checkpoint_dtype(raw),
            image_token_id=raw.get("image_token_id", 151655),
            video_token_id=raw.get("video_token_id", 151656),
            vision_start_token_id=raw.get("vision_start_token_id", 151652),
            vision_end_token_id=raw.get("vision_end_token_id", 151653),
            eos_token_ids=_eos_ids(path, text),
            deepstack_levels=len(vision.get("deepstack_visual_indexes", (8, 16, 24))),
            vision=dict(vision),
            raw=raw,
        )


def _eos_ids(path: Path, text: dict) -> list[int]:
    gen_file = path / "generation_config.json"
    eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    if eos is None:
        eos = text.get("eos_token_id")
    return [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]


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
