"""Deterministic generator of Qwen3-VL test checkpoints (random weights, locally trained tokenizer).

The layout is a real `Qwen/Qwen3-VL-*-Instruct` checkpoint's: a nested config.json (text_config with an explicit
head_dim and interleaved M-RoPE, vision_config with patch 16, learned position embeddings and deepstack
layers), weights under transformers' own names (``model.language_model.*``, ``model.visual.*``), the byte-level
BPE tokenizer and special tokens of the Qwen2-VL generator, the Qwen3-VL chat template (no default system
turn) and its image processor config (patch 16, mean/std 0.5). Same preset + seed gives identical files.
Besides the test presets, the published Qwen3-VL-2B / 4B / 8B shapes.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tools import qwen2_vl_make as base

# Qwen3-VL's template renders Qwen2-VL's turns and placeholders but adds no system turn of its own.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MEAN_STD = [0.5, 0.5, 0.5]
QK_NORM_GAIN = 2.0


@dataclass(frozen=True, slots=True)
class Preset:
    text: base.Preset  # vocab, widths, layers, heads, dtype, pixel bounds, tokenizer corpus
    head_dim: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        text=base.PRESETS["tiny"],
        head_dim=32,  # NOTE: not hidden / heads (16), so a decoder that derives it fails to load
        mrope_section=(6, 5, 5),
        vision_depth=3,
        vision_hidden=32,
        vision_heads=2,
        vision_intermediate=96,
        num_position_embeddings=64,  # an 8×8 learned grid, interpolated to every image's grid
        deepstack_visual_indexes=(0, 1),
    ),
    "small": Preset(
        text=base.PRESETS["small"],
        head_dim=64,
        mrope_section=(12, 10, 10),
        vision_depth=6,
        vision_hidden=384,
        vision_heads=6,
        vision_intermediate=1536,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(1, 3, 5),
    ),
}


def _published_text(**shape) -> base.Preset:
    """A Qwen3-VL decoder's shape with the small preset's tokenizer, the published preprocessor bounds
    (Qwen3-VL-*/preprocessor_config.json: size {"shortest_edge": 65536, "longest_edge": 16777216}, read from
    copies such as huggingface.co/hfmaster/Qwen3-VL-2B and coder3101/Qwen3-VL-2B-Instruct-heretic) and HF-like
    shards. Qwen3-VL's M-RoPE, head_dim and tower are the Qwen3-VL Preset's own fields."""
    return base.Preset(
        family="qwen3_vl",
        vocab_size=151936,
        mrope_section=(24, 20, 20),
        rope_theta=5000000.0,
        max_position_embeddings=262144,
        # NOTE: Qwen2-VL's tower fields; Qwen3-VL's tower is described by the Qwen3-VL Preset.
        vision_depth=0,
        vision_embed_dim=0,
        vision_heads=0,
        vision_mlp_ratio=0,
        dtype="bfloat16",
        min_pixels=65536,
        max_pixels=16777216,
        shard_size_bytes=base.REAL_SHARD_BYTES,
        tokenizer_vocab_size=8192,
        corpus_words=20000,
        corpus_lines=60000,
        **shape,
    )


# Published shapes. Decoder: head_dim 128, interleaved M-RoPE sections (24, 20, 20), rope_theta 5,000,000,
# max_position_embeddings 262,144, rms_norm_eps 1e-6, vocab_size 151,936 in the Qwen3-VL configs read. Tower:
# patch 16, temporal patch 2, merge 2, 2,304 learned positions, gelu_pytorch_tanh.
_DECODER_ROPE = {"head_dim": 128, "mrope_section": (24, 20, 20)}
# The tower of the 2B and 4B checkpoints (the same in both configs read; see each preset's sources).
_TOWER_2B_4B = {
    **_DECODER_ROPE,
    "vision_depth": 24,
    "vision_hidden": 1024,
    "vision_heads": 16,
    "vision_intermediate": 4096,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": (5, 11, 17),
}

PRESETS |= {
    # Qwen/Qwen3-VL-2B-Instruct: github.com/pytorch/torchtitan torchtitan/experiments/qwen3_vl/__init__.py
    # ("2B" flavour: vocab 151936, dim 2048, 28 layers, tied embedding, 16 heads, 8 kv heads, head_dim 128,
    # FFN 6144, theta 5e6, sections [24, 20, 20]; tower 1024 wide, FFN 4096, 24 blocks, 16 heads, out 2048,
    # 2304 positions, deepstack [5, 11, 17]). NOTE: max_position_embeddings was not read from a copy of this
    # checkpoint's config.json (torchtitan trains at 32768); 262,144 is the 4B and 8B configs' value.
    "qwen3-vl-2b": Preset(
        text=_published_text(
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            tie_word_embeddings=True,
        ),
        **_TOWER_2B_4B,
    ),
    # Qwen/Qwen3-VL-4B-Instruct config.json: the text half from a copy uploaded as Qwen3-VL-4B-Instruct/config.json
    # (huggingface.co/TechCarbasa/MyModels commit 400bbbf: 2560 wide, FFN 9728, 36 layers, 32 heads, 8 kv heads,
    # head_dim 128, 262144 positions, interleaved M-RoPE); rope_theta, tying and the tower from the configs of
    # fine-tunes of it (huggingface.co/amburger66/robometer-4b-lora-robotsmith-task03, chamber111/PVM-4B:
    # theta 5e6, tie_word_embeddings true, tower 24 blocks x 1024, FFN 4096, 16 heads, out 2560, deepstack
    # [5, 11, 17]). NOTE: vocab_size was not read from this checkpoint's own config (the fine-tune resized it to
    # 151,674); 151,936 is the Qwen3-VL 2B/8B and Qwen3-4B value.
    "qwen3-vl-4b": Preset(
        text=_published_text(
            hidden_size=2560,
            intermediate_size=9728,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            tie_word_embeddings=True,
        ),
        **_TOWER_2B_4B,
    ),
    # Qwen/Qwen3-VL-8B-Instruct config.json, read from copies (huggingface.co/Steinate/Cortex config.json:
    # 4096 wide, FFN 12288, 36 layers, 32 heads, 8 kv heads, head_dim 128, vocab 151936, untied, 262144
    # positions, theta 5e6, deepstack [8, 16, 24]) and torchtitan's "8B" flavour (tower 27 blocks x 1152,
    # FFN 4304, 16 heads, out 4096, 2304 positions).
    "qwen3-vl-8b": Preset(
        text=_published_text(
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            tie_word_embeddings=False,
        ),
        **_DECODER_ROPE,
        vision_depth=27,
        vision_hidden=1152,
        vision_heads=16,
        vision_intermediate=4304,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(8, 16, 24),
    ),
}


def build_config(preset: str | Preset) -> dict:
    p = PRESETS[preset] if isinstance(preset, str) else preset
    t, ids = p.text, base.token_ids(p.text)
    assert sum(p.mrope_section) * 2 == p.head_dim, "mrope_section must cover head_dim / 2"
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": t.tie_word_embeddings,
        "text_config": {
            "model_type": "qwen3_vl_text",
            "attention_bias": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "head_dim": p.head_dim,
            "hidden_act": "silu",
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "max_position_embeddings": t.max_position_embeddings,
            "num_attention_heads": t.num_heads,
            "num_hidden_layers": t.num_layers,
            "num_key_value_heads": t.num_kv_heads,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": t.rope_theta,
                "mrope_section": list(p.mrope_section),
                "mrope_interleaved": True,
            },
            "dtype": t.dtype,
            "vocab_size": t.vocab_size,
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision",
            "depth": p.vision_depth,
            "hidden_size": p.vision_hidden,
            "hidden_act": "gelu_pytorch_tanh",
            "intermediate_size": p.vision_intermediate,
            "num_heads": p.vision_heads,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": t.hidden_size,
            "num_position_embeddings": p.num_position_embeddings,
            "deepstack_visual_indexes": list(p.deepstack_visual_indexes),
        },
        "dtype": t.dtype,
    }


def make_checkpoint(
    out_dir: str | Path, preset: str | Preset = "tiny", seed: int = 0, shard_size_bytes: int | None = None
) -> Path:
    """Write a complete Qwen3-VL checkpoint directory and return its path (``preset``: a name or a
    :class:`Preset` of one's own; ``shard_size_bytes`` None: the preset's own, HF-like shards for the published
    shapes)."""
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset] if isinstance(preset, str) else preset
    config = build_config(p)
    return base.write_checkpoint(
        out_dir,
        config,
        weight_specs(config),
        functools.partial(init_tensor, config, seed),
        getattr(torch, config["dtype"]),
        p.text.shard_size_bytes if shard_size_bytes is None else shard_size_bytes,
        p.text,
        CHAT_TEMPLATE,
        {
            "preprocessor_config.json": preprocessor_config(p),
            "video_preprocessor_config.json": video_preprocessor_config(p),
        },
    )


def preprocessor_config(p: Preset) -> dict:
    cfg = base.preprocessor_config(p.text)
    cfg.update(
        image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen3VLProcessor",
        image_mean=MEAN_STD,
        image_std=MEAN_STD,
        patch_size=16,
    )
    # NOTE: v5 reads size only; the 32-px tokens make Qwen2-VL's 56² minimum a 64² one.
    cfg["min_pixels"] = max(p.text.min_pixels, 64 * 64)
    cfg["size"] = {"shortest_edge": cfg["min_pixels"], "longest_edge": cfg["max_pixels"]}
    return cfg


def video_preprocessor_config(p: Preset) -> dict:
    cfg = preprocessor_config(p)
    return {
        **{k: v for k, v in cfg.items() if k != "image_processor_type"},
        "video_processor_type": "Qwen3VLVideoProcessor",
    }


# ---------------------------------------------------------------- weights


def _hf_model_on_meta(config: dict) -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    # NOTE: a copy: transformers' config classes fill in the rope dict they are given (rope_theta, rope_type),
    # which would then be written into config.json
    cfg = Qwen3VLConfig(
        **{k: v for k, v in copy.deepcopy(config).items() if k not in ("architectures", "model_type")}
    )
    with torch.device("meta"):
        return Qwen3VLForConditionalGeneration(cfg)


def param_count(preset: str) -> int:
    return sum(math.prod(shape) for _, shape in weight_specs(build_config(preset)))


def weight_specs(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, by transformers' own names, in the order written (a tied lm_head
    is not stored)."""
    tied = config.get("tie_word_embeddings", False)
    return [
        (name, tuple(meta.shape))
        for name, meta in _hf_model_on_meta(config).state_dict().items()
        if not (tied and name == "lm_head.weight")
    ]


def _init_spec(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """The Qwen2-VL generator's non-degenerate init, read through the Qwen3-VL names.

    NOTE: q/k RMSNorm makes every query and key unit-scale, which leaves attention too flat to read any
    one image token; the norms' gain sharpens it back. The learned position table is as loud as a patch embedding (a position bug must change the
    output), and every deepstack merger writes rows as loud as the main one into the decoder's stream."""
    short = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
    if short == "visual.pos_embed.weight":
        return 0.0, 1.0
    if short.endswith(("q_norm.weight", "k_norm.weight")):
        return QK_NORM_GAIN, 0.2
    if short.startswith("visual.") and "merger" in short and short.endswith("linear_fc2.weight"):
        return 0.0, 2.0 / shape[1] ** 0.5
    if short.startswith("visual.") and short.endswith(".norm.weight"):
        return 1.0, 0.1
    return base._init_spec(short, shape)


def init_tensor(config: dict, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One transformers-named tensor from its own generator: it depends on (seed, name) only. A tied embedding
    is drawn as the output projection it also is (see the Qwen2-VL generator's TIED_HEAD_GAIN)."""
    text = config["text_config"]
    tied = config.get("tie_word_embeddings")
    head = "model.language_model.embed_tokens.weight" if tied else "lm_head.weight"
    mean, std = _init_spec("lm_head.weight" if name == head else name, shape)
    if tied and name in (head, "model.language_model.norm.weight"):
        mean, std = base.tied_head_spec(name == head, mean, std)
    rows = base._quiet_rows(text, shape[0]) if name == head else None
    return base.draw_tensor(seed, name, shape, mean, std, getattr(torch, config["dtype"]), rows)


def init_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every stored tensor at once (for small models; the writer draws shard by shard)."""
    return {name: init_tensor(config, seed, name, shape) for name, shape in weight_specs(config)}
