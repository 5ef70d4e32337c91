"""Qwen2-VL: our ragged, paged-KV decoder and the family's processor rules (grid → placeholders, M-RoPE
positions). The vision tower + merger is ours too, in ``encoder/models/qwen2_vl.py``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from encoder.models import checkpoint_dtype, read_config
from lm_engine.attention import AttentionBackend, AttentionMetadata
from runtime import cpu_kernel
from runtime.linear import halves_split, silu_gated_halves
from runtime.weights import iter_checkpoint_tensors

FAMILIES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


@dataclass(slots=True)
class Qwen2VLConfig:
    """The fields the engine needs, read from either the original or the nested (text_config) layout.

    A later family subclasses it and overrides what its config.json says differently: which families it reads,
    where the text and rope keys sit, the defaults, and its own fields (``own_fields``)."""

    families: ClassVar[dict[str, str]] = FAMILIES
    family_names: ClassVar[str] = "Qwen2-VL or Qwen2.5-VL"
    default_rope_theta: ClassVar[float] = 1000000.0
    default_max_positions: ClassVar[int] = 32768

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int]
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: list[int]
    vision: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def spatial_merge_size(self) -> int:
        return int(self.vision.get("spatial_merge_size", 2))

    @classmethod
    def from_dir(cls, path: str | Path) -> Qwen2VLConfig:
        path = Path(path)
        raw = read_config(path)
        archs = raw.get("architectures") or []
        # NOTE: Qwen2.5-VL's decoder and image positions are Qwen2-VL's; only its tower differs (encoder/models).
        if raw.get("model_type") not in cls.families and not set(archs) & set(cls.families.values()):
            raise ValueError(
                f"{path / 'config.json'}: model_type {raw.get('model_type')!r} is not a {cls.family_names} checkpoint"
            )
        text, rope = cls.text_and_rope(raw)
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or text.get("rope_theta") or cls.default_rope_theta),
            mrope_section=list(rope.get("mrope_section") or cls.default_mrope_section(text)),
            max_position_embeddings=text.get("max_position_embeddings", cls.default_max_positions),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            dtype=checkpoint_dtype(raw),
            image_token_id=raw.get("image_token_id", 151655),
            video_token_id=raw.get("video_token_id", 151656),
            vision_start_token_id=raw.get("vision_start_token_id", 151652),
            vision_end_token_id=raw.get("vision_end_token_id", 151653),
            eos_token_ids=eos_token_ids(path, text),
            vision=dict(raw.get("vision_config") or {}),
            raw=raw,
            **cls.own_fields(raw, text, rope),
        )

    @staticmethod
    def text_and_rope(raw: dict) -> tuple[dict, dict]:
        """The text model's keys (flat, or overridden by a nested text_config) and its rope dict."""
        text = {**raw, **(raw.get("text_config") or {})}
        return text, text.get("rope_scaling") or text.get("rope_parameters") or {}

    @staticmethod
    def default_mrope_section(text: dict) -> list[int]:
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        return [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]

    @staticmethod
    def own_fields(raw: dict, text: dict, rope: dict) -> dict:
        """A subclass's fields beyond these."""
        return {}


def eos_token_ids(path: Path, text: dict) -> list[int]:
    """The stop ids: generation_config.json's where it names any, else the text config's."""
    eos = []
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    if not eos:
        cfg_eos = text.get("eos_token_id")
        eos = cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else []
    return [int(e) for e in eos]


# -- processor rules ---------------------------------------------------------------------------------------
def mrope_positions(
    token_ids: list[int], image_spans: list[tuple], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions ([3, len]) of a prompt and the delta that generated tokens add to their index.

    ``image_spans``: (offset of the first placeholder, (t, h, w) patch grid[, time interval]) per image or
    video, in order. Text advances all three axes together; an image's tokens sit on its (t, h, w) merged grid
    starting at the running position, and the text after it resumes past the grid's largest spatial side
    (transformers' get_rope_index: not past its temporal one). A video's temporal index is its patch index
    times the interval (Qwen2.5-VL: tokens_per_second · seconds per temporal patch, a float32 tensor as
    transformers computes it, truncated), 1 elsewhere.
    """
    n = len(token_ids)
    pos = torch.empty(3, n, dtype=torch.long)
    cur = 0
    i = 0
    for offset, (t, h, w), *interval in image_spans:
        if offset > i:
            pos[:, i:offset] = torch.arange(cur, cur + offset - i)
            cur += offset - i
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        steps = torch.arange(t)
        if interval and interval[0] != 1:
            steps = (steps * interval[0]).long()
        tt = steps.view(-1, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw)
        length = t * gh * gw
        pos[0, offset : offset + length] = tt.reshape(-1) + cur
        pos[1, offset : offset + length] = hh.reshape(-1) + cur
        pos[2, offset : offset + length] = ww.reshape(-1) + cur
        cur += max(gh, gw)
        i = offset + length
    if i < n:
        pos[:, i:n] = torch.arange(cur, cur + n - i)
        cur += n - i
    delta = (int(pos.max()) + 1 - n) if n else 0
    return pos, delta


# -- decoder -----------------------------------------------------------------------------------------------
# Elements up to which the decoder's norms, rotary and silu · up run on the compiled library on the calling thread
# alone (one pass where torch makes seven or two; no other thread to wake, no wait for another call): a decode
# step's handful of rows. Past it (a prefill chunk), on all of torch's threads, on the library's prefill pool.
STEP_KERNEL_ELEMS = 1 << 16


def kernel_threads(elems: int) -> dict:
    """The threads and pool a decoder kernel call of ``elems`` elements runs on (see STEP_KERNEL_ELEMS)."""
    return (
        {"threads": 1}
        if elems <= STEP_KERNEL_ELEMS
        else {"threads": torch.get_num_threads(), "pool": "prefill"}
    )


def use_step_kernels(module: nn.Module, lib) -> int:
    """Hand the compiled library (``runtime.cpu_kernel.load()``) to every decoder norm, MLP and attention under
    ``module`` (CPU, bfloat16 only: elsewhere they keep torch's ops); returns how many took it."""
    taken = 0
    for child in module.modules():
        take = getattr(child, "take_lib", None)  # the norms, MLPs and attentions of each family
        if take is not None and take(lib):
            taken += 1
    return taken


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.lib = None

    def take_lib(self, lib) -> bool:
        if lib is None or self.weight.device.type != "cpu" or self.weight.dtype != torch.bfloat16:
            return False
        self.lib = lib
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lib is not None and x.dtype == self.weight.dtype:
            # NOTE: the same formula in one pass; bfloat16 equal but for rare one-step differences (the sum of
            # squares is added in another order): tests/lm_engine/test_step_kernels.py
            return cpu_kernel.rms_norm(
                self.lib, x, self.weight.detach(), self.eps, **kernel_threads(x.numel())
            )
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MRotaryEmbedding(nn.Module):
    """Rotary embedding whose frequency bands read the t, h or w position axis (``mrope_section``)."""

    def __init__(self, head_dim: int, theta: float, section: list[int]) -> None:
        super().__init__()
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = torch.cat([torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(section)])
        self.register_buffer("axis", axis, persistent=False)

    def _apply(self, fn, recurse=True):
        # NOTE: a whole-module cast (``.to(bfloat16)``) must not round the frequencies, as transformers keeps
        # them: position × a bf16 inv_freq is off by whole radians past a few hundred tokens. Device moves
        # apply; dtype casts do not.
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] → cos, sin [T, head_dim]."""
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, D/2]
        band = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)
        emb = torch.cat([band, band], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def step_rotary(lib, qkv: torch.Tensor, heads: int, head_dim: int, cos, sin, norms=None) -> bool:
    """Rotate (and with ``norms``, RMS-norm first: see :func:`cpu_kernel.rope_heads`) the first ``heads`` heads of the
    fused projection in place on the compiled library, where it was handed one (bfloat16); ``False``: the caller
    runs torch's ops. The same rounding as torch's: tests/lm_engine/test_step_kernels.py"""
    if lib is None or qkv.dtype != torch.bfloat16 or cos.dtype != qkv.dtype:
        return False
    cpu_kernel.rope_heads(lib, qkv, heads, head_dim, cos, sin, norms, **kernel_threads(qkv.numel()))
    return True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen2VLConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.lib = None

    def take_lib(self, lib) -> bool:
        # a packed layer may hold no parameter: the step's dtype decides then
        weight = next(self.o_proj.parameters(), None)
        if lib is None or (weight is not None and weight.device.type != "cpu"):
            return False
        self.lib = lib
        return True

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q's and k's heads rotated together: the same ops on every element, once instead of twice
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if not step_rotary(self.lib, qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin):
            c, s = cos.unsqueeze(1), sin.unsqueeze(1)
            qk = qk * c + _rotate_half(qk) * s
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (rotated in place by the kernel)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen2VLConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.lib = None

    def take_lib(self, lib) -> bool:
        weight = next(self.down_proj.parameters(), None)
        if lib is None or (weight is not None and weight.device.type != "cpu"):
            return False
        self.lib = lib
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if halves_split(self.gate_up_proj):  # the float32 kernel: gate, up and silu · up in one pass
            return self.down_proj(silu_gated_halves(self.gate_up_proj, x))
        gate_up = self.gate_up_proj(x)
        if self.lib is not None and gate_up.dtype == torch.bfloat16:
            # silu rounded, then the product, as torch computes it (tests/runtime/test_cpu_kernel_attention.py),
            # reading the two halves in place
            threads = kernel_threads(gate_up.numel())
            return self.down_proj(cpu_kernel.silu_mul_halves(self.lib, gate_up, **threads))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals; ``attention``: the family's attention module (Qwen3-VL's
    norms q and k per head), built from the same config."""

    def __init__(self, cfg: Qwen2VLConfig, attention: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.self_attn = (attention or Attention)(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2VLDecoder(nn.Module):
    """Takes flat ragged tokens ([T]), their M-RoPE positions ([3, T]) and optional image rows.

    Qwen3-VL's decoder (``lm_engine.models.qwen3_vl``) is this one with its own attention, rotary bands and
    deepstack rows: it names them in :attr:`attention` and :meth:`make_rotary`."""

    attention: type[nn.Module] = Attention
    # a decode step's layers in one call each (lm_engine/models/fused_decode.py), where it applies
    fused = None

    def __init__(self, cfg: Qwen2VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.attention) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = self.make_rotary(cfg)

    @staticmethod
    def make_rotary(cfg) -> MRotaryEmbedding:
        return MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def fused_step(self, input_ids, positions, kv_caches, meta, mm_rows) -> torch.Tensor | None:
        """The step's hidden states through :attr:`fused`, or ``None`` where it does not apply."""
        if self.fused is None or not self.fused.applies(input_ids, meta, mm_rows):
            return None
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        return self.norm(self.fused.run(x, cos, sin, kv_caches, meta))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        mm_rows: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        fused = self.fused_step(input_ids, positions, kv_caches, meta, mm_rows)
        if fused is not None:
            return fused
        x = self.embed_tokens(input_ids)
        levels = self.place_images(x, mm_rows, mm_embeds)
        cos, sin = self.rotary(positions, x.dtype)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, k_cache, v_cache, meta, backend)
            if i < len(levels):  # a deepstack level goes into the image rows after layer i
                x[mm_rows] = x[mm_rows] + levels[i]
        return self.norm(x)

    def place_images(
        self, x: torch.Tensor, mm_rows: torch.Tensor | None, mm_embeds: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Write the image rows' embeddings into ``x``; returns the levels to add after the first layers (none
        here: Qwen3-VL's deepstack has them)."""
        if mm_rows is not None and mm_rows.numel():
            x[mm_rows] = mm_embeds.to(x.dtype)
        return []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def layer_tensors(self) -> int:
        """The checkpoint tensors of one layer: q/k/v weight and bias, o, gate, up, down, two norms."""
        return 6 + 1 + 2 + 1 + 2

    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        """Load the decoder's tensors from the checkpoint (original or nested names, sharded or not)."""
        cfg = self.cfg
        params = dict(self.named_parameters())
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        fused = {  # checkpoint leaf → (our leaf, row offset)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", q),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", cfg.intermediate_size),
        }
        loaded: set[str] = set()
        for name, tensor in iter_checkpoint_tensors(path):
            name = name.replace("model.language_model.", "model.")
            if name.startswith(("visual.", "model.visual.")):
                continue
            name = name.removeprefix("model.")
            target, offset = name, None
            for src, (dst, off) in fused.items():
                if f".{src}." in name:
                    target, offset = name.replace(src, dst), off
                    break
            if target not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint {path}")
            param = params[target]
            if offset is None:
                param.copy_(tensor)
            else:
                param[offset : offset + tensor.shape[0]].copy_(tensor)
                target = f"{target}@{offset}"
            loaded.add(target)
        if "lm_head.weight" not in loaded and cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        expected = 3 + cfg.num_hidden_layers * self.layer_tensors()  # and embed, norm, head
        if len(loaded) != expected:
            raise ValueError(
                f"checkpoint {path} is missing decoder tensors ({len(loaded)}/{expected} loaded)"
            )
