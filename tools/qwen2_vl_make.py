"""Deterministic generator of Qwen2-VL test checkpoints (random weights, locally trained tokenizer).

The output directory has the layout of a real `Qwen/Qwen2-VL-*-Instruct` checkpoint: the original flat
`config.json`, weights under the original (pre-transformers-v5) key names, a byte-level BPE tokenizer with
the Qwen2-VL special tokens appended after the learned vocab, the Qwen2-VL chat template and the image
processor config. Same preset + seed gives byte-identical files; the tokenizer depends on the preset only.

Besides the test presets, the published Qwen2-VL-2B / Qwen2.5-VL-3B / Qwen2.5-VL-7B shapes (random weights,
HF-like shards, drawn and written one shard at a time).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's own pre-tokenizer split (digits one by one, contractions, punctuation runs).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Renders the same text as the template shipped with Qwen2-VL-*-Instruct.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True, slots=True)
class Preset:
    vocab_size: int  # config vocab_size: the embedding's and lm_head's rows
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mrope_section: tuple[int, int, int]
    rope_theta: float
    vision_depth: int
    vision_embed_dim: int
    vision_heads: int
    vision_mlp_ratio: int
    dtype: str
    min_pixels: int
    max_pixels: int
    corpus_words: int  # distinct pseudo-words, enough for BPE to reach the vocab size
    corpus_lines: int
    max_position_embeddings: int = 32768
    # Published shapes; the defaults keep the test presets' files byte for byte as they were.
    family: str | None = None  # the one family this shape stands for (None: any of FAMILIES)
    tokenizer_vocab_size: int | None = None  # learned BPE + specials when smaller than vocab_size
    tie_word_embeddings: bool = False
    max_window_layers: int | None = None  # None: num_layers
    sliding_window: int | None = None  # None: max_position_embeddings
    vision_intermediate_size: int | None = None  # Qwen2.5-VL tower MLP; None: from vision_mlp_ratio
    window_size: int = 112  # Qwen2.5-VL window attention, pixels
    fullatt_block_indexes: tuple[int, ...] | None = None  # Qwen2.5-VL; None: the last block of each half
    shard_size_bytes: int | None = None  # make_checkpoint's default; None: one model.safetensors

    @property
    def tokenizer_vocab(self) -> int:
        """Rows the tokenizer can produce; the rest of vocab_size are padding rows, as in released checkpoints
        (Qwen2-VL's config has 151,936 rows for a 151,665-token tokenizer)."""
        return self.tokenizer_vocab_size or self.vocab_size


# NOTE: real-size presets write HF-like shards: save_pretrained's shards of the released checkpoints are
# <= 4-5 GB (Qwen2-VL-2B-Instruct: 3.99 GB + 429 MB).
REAL_SHARD_BYTES = 4_000_000_000
# The real-size presets share the small preset's tokenizer (8,192 tokens, the Qwen2-VL special tokens last);
# the embedding keeps the published row count.
_REAL_TOKENIZER = dict(tokenizer_vocab_size=8192, corpus_words=20000, corpus_lines=60000)
# Preprocessor bounds of Qwen2-VL-*/Qwen2.5-VL-* preprocessor_config.json (Qwen/Qwen2-VL-2B on the Hub:
# "min_pixels": 3136, "max_pixels": 12845056; Qwen2.5-VL copies, e.g. mlx-community/Qwen2.5-VL-3B-Instruct-4bit,
# say the same).
_QWEN2_PIXELS = dict(min_pixels=3136, max_pixels=12845056)
# The tower of Qwen2.5-VL-3B and -7B (the same in both configs read; see each preset's sources), with what every
# real-size Qwen2.5-VL preset shares.
_QWEN25_TOWER = dict(
    vision_depth=32,
    vision_embed_dim=1280,
    vision_heads=16,
    vision_mlp_ratio=4,  # unused by Qwen2.5-VL: vision_intermediate_size is explicit
    vision_intermediate_size=3420,
    window_size=112,
    fullatt_block_indexes=(7, 15, 23, 31),
    dtype="bfloat16",
    shard_size_bytes=REAL_SHARD_BYTES,
    **_QWEN2_PIXELS,
    **_REAL_TOKENIZER,
)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mrope_section=(2, 3, 3),
        # NOTE: 1e4 rather than Qwen's 1e6: with head_dim 16 the h/w M-RoPE sections would otherwise
        # rotate so slowly that position bugs could not change any output.
        rope_theta=10000.0,
        vision_depth=2,
        vision_embed_dim=32,
        vision_heads=2,
        vision_mlp_ratio=4,
        dtype="float32",
        min_pixels=3136,
        max_pixels=1003520,
        corpus_words=3000,
        corpus_lines=12000,
    ),
    # Tests: the released models' head dim (128, 64 in the tower), M-RoPE sections and rope theta, with the
    # tiny preset's vocab (the same tokenizer) and few layers, so comparing it with transformers stays cheap.
    "wide": Preset(
        family="qwen2_vl",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        mrope_section=(16, 24, 24),
        rope_theta=1000000.0,
        vision_depth=2,
        vision_embed_dim=128,
        vision_heads=2,
        vision_mlp_ratio=2,
        dtype="float32",
        min_pixels=3136,
        max_pixels=1003520,
        corpus_words=3000,
        corpus_lines=12000,
    ),
    # The embedded demo model (trained by `vlmserve train-demo`): the tiny preset's tokenizer, a tower wide
    # and deep enough to read digits, a small decoder (five question phrasings need little language).
    "demo": Preset(
        family="qwen2_vl",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        mrope_section=(8, 12, 12),
        rope_theta=10000.0,
        vision_depth=8,
        vision_embed_dim=256,
        vision_heads=4,
        vision_mlp_ratio=4,
        dtype="bfloat16",
        # at least 16 visual tokens: images under 112 x 112 px are scaled up (their digits were too small to
        # read at 4-9 tokens); at most 128: the ladder then spans 128, 64, 32 and 16 tokens
        min_pixels=12544,
        max_pixels=100352,
        corpus_words=3000,
        corpus_lines=12000,
    ),
    "small": Preset(
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=2,
        mrope_section=(8, 12, 12),
        rope_theta=1000000.0,
        vision_depth=6,
        vision_embed_dim=384,
        vision_heads=6,
        vision_mlp_ratio=4,
        dtype="bfloat16",
        min_pixels=3136,
        max_pixels=1003520,
        corpus_words=20000,
        corpus_lines=60000,
    ),
    # Qwen/Qwen2-VL-2B-Instruct config.json, read from verbatim copies that name it as _name_or_path
    # (huggingface.co/onnx-community/Qwen2-VL-2B-Instruct and lightonai/MonoQwen2-VL-v0.1 config.json). Its
    # vision_config only sets hidden_size 1536 (the merger's output); depth 32, embed_dim 1280, mlp_ratio 4,
    # num_heads 16, patch 14, temporal patch 2 and merge 2 are Qwen2VLVisionConfig's defaults, which the
    # checkpoint relies on (its 32-block, 1280-wide tower: model.safetensors.index.json of Qwen/Qwen2-VL-2B).
    "qwen2-vl-2b": Preset(
        family="qwen2_vl",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        mrope_section=(16, 24, 24),
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        max_window_layers=28,
        sliding_window=32768,
        tie_word_embeddings=True,
        vision_depth=32,
        vision_embed_dim=1280,
        vision_heads=16,
        vision_mlp_ratio=4,
        dtype="bfloat16",
        shard_size_bytes=REAL_SHARD_BYTES,
        **_QWEN2_PIXELS,
        **_REAL_TOKENIZER,
    ),
    # Qwen/Qwen2.5-VL-3B-Instruct config.json, read from verbatim copies: huggingface.co/huihui-ai/
    # Qwen2.5-VL-3B-Instruct-abliterated config.json and github.com/sophgo/LLM-TPU models/Qwen2_5_VL/config/
    # config.json (the latter edits max_position_embeddings to 8192; the Hub copies, also
    # dahwinsingularity/vllm2 with _name_or_path Qwen/Qwen2.5-VL-3B-Instruct, say 128000).
    "qwen2.5-vl-3b": Preset(
        family="qwen2_5_vl",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_layers=36,
        num_heads=16,
        num_kv_heads=2,
        mrope_section=(16, 24, 24),
        rope_theta=1000000.0,
        max_position_embeddings=128000,
        max_window_layers=70,
        sliding_window=32768,
        tie_word_embeddings=True,
        **_QWEN25_TOWER,
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct config.json: the text half from huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct-AWQ
    # config.json (_name_or_path Qwen/Qwen2.5-VL-7B-Instruct; the AWQ quantization leaves the shapes), the tower
    # from full copies (huggingface.co/Icey444/Ground-R1_orig_1050 config.json: depth 32, hidden 1280,
    # intermediate 3420, 16 heads, out 3584, window 112, full attention in blocks 7/15/23/31). NOTE: its
    # vocab_size is 152,064, not Qwen2-VL-2B's 151,936, and its embedding is not tied.
    "qwen2.5-vl-7b": Preset(
        family="qwen2_5_vl",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        mrope_section=(16, 24, 24),
        rope_theta=1000000.0,
        max_position_embeddings=128000,
        max_window_layers=28,
        sliding_window=32768,
        tie_word_embeddings=False,
        **_QWEN25_TOWER,
    ),
}


def token_ids(preset: str | Preset) -> dict[str, int]:
    """Ids of the special tokens: they follow the learned vocab, in Qwen2-VL's order."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    first = p.tokenizer_vocab - len(SPECIAL_TOKENS)
    return {tok: first + i for i, tok in enumerate(SPECIAL_TOKENS)}


FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def build_config(preset: str | Preset, family: str | None = None) -> dict:
    """config.json in the original (flat, pre-v5) layout of the family's released checkpoints."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    family = resolve_family(p, family)
    ids = token_ids(p)
    head_dim = p.hidden_size // p.num_heads
    assert sum(p.mrope_section) * 2 == head_dim, "mrope_section must cover head_dim / 2"
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "max_window_layers": p.max_window_layers or p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_hidden_layers": p.num_layers,
        "num_key_value_heads": p.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": p.rope_theta,
        "sliding_window": p.sliding_window or p.max_position_embeddings,
        "tie_word_embeddings": p.tie_word_embeddings,
        "torch_dtype": p.dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": p.vision_depth,
            "embed_dim": p.vision_embed_dim,
            "mlp_ratio": p.vision_mlp_ratio,
            "num_heads": p.vision_heads,
            "in_chans": 3,
            "in_channels": 3,
            "hidden_size": p.hidden_size,
            "hidden_act": "quick_gelu",
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": list(p.mrope_section)},
        "vocab_size": p.vocab_size,
    } | (_qwen2_5_vl_fields(p) if family == "qwen2_5_vl" else {})


def _qwen2_5_vl_fields(p: Preset) -> dict:
    """Qwen2.5-VL: the tower's own width is ``hidden_size`` there, RMSNorm + gated SiLU MLP, 112-pixel windows
    (8 patches) with full attention in the last block of each half."""
    half = max(2, p.vision_depth // 2)
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vision_config": {
            "depth": p.vision_depth,
            "hidden_size": p.vision_embed_dim,
            "intermediate_size": p.vision_intermediate_size
            or p.vision_embed_dim * p.vision_mlp_ratio // 2 + 8,
            "num_heads": p.vision_heads,
            "in_chans": 3,
            "in_channels": 3,
            "out_hidden_size": p.hidden_size,
            "hidden_act": "silu",
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": p.window_size,
            "fullatt_block_indexes": list(p.fullatt_block_indexes or range(half - 1, p.vision_depth, half)),
            "tokens_per_second": 2,
        },
    }


def resolve_family(preset: str | Preset, family: str | None = None) -> str:
    """The family to write: the preset's own (a published shape stands for one family), else ``family`` or
    Qwen2-VL. A family that contradicts the preset's is an error."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    if p.family is not None and family not in (None, p.family):
        name = preset if isinstance(preset, str) else "this"
        raise ValueError(f"the {name} preset exists for family {p.family} only, not {family}")
    return family or p.family or "qwen2_vl"


def make_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    shard_size_bytes: int | None = None,
    family: str | None = None,
) -> Path:
    """Write a complete checkpoint directory and return its path (created; our files overwritten).

    `shard_size_bytes` splits the weights into `model-0000i-of-0000n.safetensors` + index, as large
    real checkpoints are stored; None takes the preset's own (HF-like shards for the published shapes, one
    file for the test presets). `family` defaults to the preset's, else Qwen2-VL.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]
    family = resolve_family(preset, family)
    config = build_config(p, family)
    return write_checkpoint(
        out_dir,
        config,
        weight_specs(config),
        functools.partial(init_tensor, config, seed),
        getattr(torch, config["torch_dtype"]),
        p.shard_size_bytes if shard_size_bytes is None else shard_size_bytes,
        p,
        CHAT_TEMPLATE,
        {"preprocessor_config.json": preprocessor_config(p, family)},
    )


def write_checkpoint(
    out_dir: str | Path,
    config: dict,
    specs: list[tuple[str, tuple[int, ...]]],
    init: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: torch.dtype,
    shard_size_bytes: int,
    text: Preset,
    chat_template: str,
    files: dict[str, dict],
) -> Path:
    """The writer every family's maker shares: into ``out_dir`` (created; our files overwritten, stale shards
    removed) the config, the weights ``specs`` names drawn by ``init`` in ``dtype`` (sharded as
    :func:`write_weights` does), the tokenizer of the text preset ``text`` carrying ``chat_template``, the
    generation config, ``chat_template.json`` and the family's other JSON ``files``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    _write_json(out / "config.json", config)
    write_weights(out, specs, init, dtype, shard_size_bytes)
    _write_tokenizer(out, text, chat_template)
    _write_json(out / "generation_config.json", generation_config(text))
    for name, obj in files.items():
        _write_json(out / name, obj)
    _write_json(out / "chat_template.json", {"chat_template": chat_template})
    return out


def generation_config(p: Preset) -> dict:
    ids = token_ids(p)
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "do_sample": False,
    }


def preprocessor_config(p: Preset, family: str = "qwen2_vl") -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        # NOTE: v4 reads min/max_pixels, v5 reads size; both say the same thing.
        "min_pixels": p.min_pixels,
        "max_pixels": p.max_pixels,
        "size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
    }


# ---------------------------------------------------------------- weights


def _hf_model_on_meta(config: dict) -> torch.nn.Module:
    import transformers

    prefix = "Qwen2_5_VL" if config["model_type"] == "qwen2_5_vl" else "Qwen2VL"
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForConditionalGeneration")
    # NOTE: a copy: transformers' config classes fill in the rope dict they are given (rope_theta, rope_type),
    # which would then be written into config.json
    cfg = config_cls(
        **{k: v for k, v in copy.deepcopy(config).items() if k not in ("architectures", "model_type")}
    )
    with torch.device("meta"):
        return model_cls(cfg)


def original_name(v5_name: str) -> str:
    """Inverse of transformers v5's Qwen2VLForConditionalGeneration checkpoint renaming."""
    if v5_name.startswith("model.visual."):
        return v5_name.removeprefix("model.")
    if v5_name.startswith("model.language_model."):
        return "model." + v5_name.removeprefix("model.language_model.")
    return v5_name


def param_count(preset: str) -> int:
    """Parameters of the preset's model, counted without materialising any weights (a tied head once)."""
    return sum(math.prod(shape) for _, shape in weight_specs(build_config(preset)))


def weight_specs(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the checkpoint stores, under the original names, in the order written.

    The list is transformers' own model (built on the meta device from ``config``), so the writer cannot drift
    from what transformers loads; a tied lm_head is not stored, as in the released tied checkpoints.
    """
    tied = config.get("tie_word_embeddings", False)
    return [
        (original_name(name), tuple(meta.shape))
        for name, meta in _hf_model_on_meta(config).state_dict().items()
        if not (tied and name == "lm_head.weight")
    ]


def _init_spec(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the normal each tensor is drawn from.

    NOTE: plain 0.02-std init makes a small random model emit one token forever whatever the prompt.
    Here every sublayer writes ~unit-scale updates into a ~unit-scale residual stream, attention is
    sharp enough to depend on content and position, the merger's output is as loud as a token
    embedding (so images steer the text), and lm_head is wide (logit std ~8) so top-2 logits are
    rarely near-tied. Norm weights ~1 and biases are non-zero on purpose: an engine that forgets to
    load one of them produces different tokens. Every sublayer reads a normed input and adds a bounded update,
    so the residual stream grows additively with depth (about its square root), never geometrically: at the
    published depths (28-36 layers) its rms stays at 5-7 in bf16 (tests/tools/test_published_presets.py).
    """
    fan_in = math.prod(shape[1:])
    module, kind = name.rsplit(".", 2)[-2:]
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name == "lm_head.weight":
        return 0.0, 8.0 / fan_in**0.5
    if "norm" in module or module == "ln_q":
        return (1.0, 0.1) if kind == "weight" else (0.0, 0.1)
    if kind == "bias":
        return 0.0, 0.5 if module in ("q_proj", "k_proj") else 0.1
    if module in ("q_proj", "k_proj", "qkv"):
        return 0.0, 1.6 / fan_in**0.5
    if name.startswith("visual.merger.mlp.2."):
        return 0.0, 2.0 / fan_in**0.5
    return 0.0, 1.0 / fan_in**0.5


def init_tensor(config: dict, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One original-named tensor, drawn from its own generator: its values depend on (seed, name) only."""
    tied = config.get("tie_word_embeddings", False)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    mean, std = _init_spec("lm_head.weight" if name == head else name, shape)
    if tied and name in (head, "model.norm.weight"):
        mean, std = tied_head_spec(name == head, mean, std)
    rows = _quiet_rows(config, shape[0]) if name == head else None
    return draw_tensor(seed, name, shape, mean, std, getattr(torch, config["torch_dtype"]), rows)


# NOTE: a tied embedding is also the output projection, and each token's own row sits in the residual stream it
# is scored against: drawn at lm_head's scale (logit std ~8) that self-score alone is worth ~1.5 logit stds and
# greedy decoding repeats one token (seen on 28- and 36-layer scaled-down 2B/3B shapes). So the tied table is 4x
# quieter and the final norm's gain 4x louder: the same logit scale, a 4x smaller self-score. The first layer
# reads its input through RMSNorm, so the quieter rows lose nothing there.
TIED_HEAD_GAIN = 4.0


def tied_head_spec(is_table: bool, mean: float, std: float) -> tuple[float, float]:
    """(mean, std) of a tied embedding table (``is_table``) or of the final norm in front of it."""
    if is_table:
        return mean, std / TIED_HEAD_GAIN
    return mean * TIED_HEAD_GAIN, std * TIED_HEAD_GAIN


def _quiet_rows(text_config: dict, n: int) -> torch.Tensor:
    """Per-row scale of the output projection: markup tokens (image pads, box markers) and padding rows past the
    tokenizer are never predicted, as in a trained model; the two end tokens keep full scale so EOS stays
    possible but rare."""
    scale = torch.ones(n)
    scale[text_config["bos_token_id"] :] = 0.1  # NOTE: <|endoftext|> is the first special token
    scale[[text_config["eos_token_id"], text_config["bos_token_id"]]] = 1.0
    return scale


# Larger tensors are drawn in row blocks of at most this many values, so drawing one needs its bf16 bytes plus
# one float32 block (64 MiB), not a float32 copy of all of it (the 7B embedding would be 2.2 GB). Every test
# preset's tensors are below it and keep their one-draw values.
DRAW_BLOCK = 1 << 24


def draw_tensor(
    seed: int,
    name: str,
    shape: tuple[int, ...],
    mean: float,
    std: float,
    dtype: torch.dtype,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """N(mean, std) values of ``shape`` from the generator seeded by (seed, name), scaled per row by
    ``row_scale`` in float32, then cast to ``dtype``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

    def block(rows: int, first: int) -> torch.Tensor:
        t = torch.randn((rows, *shape[1:]), generator=gen, dtype=torch.float32).mul_(std).add_(mean)
        if row_scale is not None:
            t.mul_(row_scale[first : first + rows].view(-1, *[1] * (len(shape) - 1)))
        return t.to(dtype)

    if math.prod(shape) <= DRAW_BLOCK:
        return block(shape[0], 0).reshape(shape).contiguous()
    out = torch.empty(shape, dtype=dtype)
    step = max(1, DRAW_BLOCK // math.prod(shape[1:]))
    for first in range(0, shape[0], step):
        rows = min(step, shape[0] - first)
        out[first : first + rows] = block(rows, first)
    return out


def init_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every stored tensor at once, by original name (for small models; the writer draws shard by shard)."""
    return {name: init_tensor(config, seed, name, shape) for name, shape in weight_specs(config)}


def plan_shards(
    specs: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, shard_size_bytes: int | None
) -> list[list[str]]:
    """Tensor names per file, in order: one file, or consecutive runs of at most ``shard_size_bytes`` each
    (a single larger tensor gets a file of its own), as save_pretrained splits."""
    if shard_size_bytes is None:
        return [[name for name, _ in specs]]
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(
    out: Path,
    specs: list[tuple[str, tuple[int, ...]]],
    make: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: torch.dtype,
    shard_size_bytes: int | None,
) -> None:
    """Write ``model.safetensors``, or shards + ``model.safetensors.index.json`` as Hugging Face lays them out.

    NOTE: shard by shard: a shard's tensors are drawn, saved and dropped before the next shard's are drawn, so
    memory holds one shard (<= shard_size_bytes) plus one draw block, whatever the model's size."""
    shards = plan_shards(specs, dtype, shard_size_bytes)
    shapes = dict(specs)
    if shard_size_bytes is None:
        _save({name: make(name, shapes[name]) for name in shards[0]}, out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save({name: make(name, shapes[name]) for name in names}, out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(math.prod(shape) * dtype.itemsize for shape in shapes.values())
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, path, metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates it 0600; the rest of the directory is world-readable


# ---------------------------------------------------------------- tokenizer

_WORDS_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not "
    "but what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make than "
    "first been its who now people my made over did down only way find use may water long little very "
    "after words called just where most know get through back much before go good new write our used me "
    "man too any day same right look think also around another came come work three word must because "
    "does part even place well such here take why things help put years different away again off went "
    "old number great tell men say small every found still between name should home big give air line "
    "set own under read last never us left end along while might next sound below saw something thought "
    "both few those always looked show large often together asked house world going want school important "
    "until form food keep children feet land side without boy once animals life enough took sometimes four "
    "head above kind began almost live page got earth need far hand high year mother light parts country "
    "father let night following picture being study second eyes soon times story boys since white days "
    "ever paper hard near sentence better best across during today others however sure means knew its try "
    "told young miles sun ways thing whole hear example heard several change answer room sea against top "
    "image photo cat dog tree car red blue green yellow black color left right center background person "
    "table chart document invoice total price date street city river mountain sky cloud window door"
)
_UNICODE_TEXT = "café résumé naïve élève Zürich 中文 你好世界 图片 东京 🙂 🚀 🐱 → …"
_CONSONANTS_TEXT = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl br"
_VOWELS_TEXT = "a e i o u ai ea ou io"
_WORDS, _UNICODE = _WORDS_TEXT.split(), _UNICODE_TEXT.split()
_CONSONANTS, _VOWELS = _CONSONANTS_TEXT.split(), _VOWELS_TEXT.split()
_QUESTIONS = (
    "What is in the picture?",
    "Describe the image.",
    "How many people are there?",
    "What color is the car?",
    "Read the text in the document.",
    "Answer the question.",
)


def synthetic_corpus(n_words: int, n_lines: int, seed: int = 1234) -> list[str]:
    """English-like lines: Zipf-drawn real and pseudo words, numbers, punctuation, accents, CJK, emoji."""
    rng = random.Random(seed)
    pseudo = [
        "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
        + rng.choice(["", "n", "s", "r", "t", "l", "ing", "ed"])
        for _ in range(n_words)
    ]
    lexicon = list(_WORDS) + pseudo

    def word() -> str:
        r = rng.random()
        if r < 0.03:
            return rng.choice(_UNICODE)
        if r < 0.08:
            return str(
                rng.choice([rng.randint(0, 100), rng.randint(1900, 2030), round(rng.uniform(0, 999), 2)])
            )
        if r < 0.55:
            return _WORDS[min(int(rng.paretovariate(1.0)) - 1, len(_WORDS) - 1)]
        return rng.choice(lexicon)

    lines = []
    for _ in range(n_lines):
        if rng.random() < 0.05:
            lines.append(rng.choice(_QUESTIONS))
            continue
        ws = [word() for _ in range(rng.randint(3, 16))]
        ws[0] = ws[0].capitalize()
        if rng.random() < 0.2:
            ws.insert(rng.randrange(1, len(ws)), rng.choice([",", " -", ":", ";", " (", ")", '"', "'s"]))
        sentence = " ".join(ws).replace(" ,", ",").replace(" :", ":").replace(" ;", ";").replace(" 's", "'s")
        lines.append(sentence + rng.choice([".", ".", ".", "!", "?", "...", "\n"]))
    return lines


def train_tokenizer(preset: str | Preset):
    """Byte-level BPE with Qwen2's pre-tokenizer, trained on the synthetic corpus; specials appended."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    return _train_bpe(p.tokenizer_vocab, p.corpus_words, p.corpus_lines)


@functools.cache
def _tokenizer_json(vocab_size: int, corpus_words: int, corpus_lines: int) -> str:
    # NOTE: training is deterministic, so once per process: a test session builds several checkpoints
    # whose presets share one tokenizer.
    return _train_bpe(vocab_size, corpus_words, corpus_lines).to_str(pretty=True)


def _train_bpe(vocab_size: int, corpus_words: int, corpus_lines: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    learned = vocab_size - len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=learned,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(corpus_words, corpus_lines), trainer)
    if tok.get_vocab_size() != learned:
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} tokens, wanted {learned}: enlarge the corpus")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _write_tokenizer(out: Path, p: Preset, chat_template: str = CHAT_TEMPLATE) -> None:
    text = _tokenizer_json(p.tokenizer_vocab, p.corpus_words, p.corpus_lines)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    model = json.loads(text)["model"]
    _write_json(out / "vocab.json", model["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in token_ids(p).items()
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
            "bos_token": None,
            "chat_template": chat_template,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": p.max_position_embeddings,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default=None, choices=FAMILIES, help="default: the preset's, else qwen2_vl")
    args = ap.parse_args()
    print(make_checkpoint(args.out_dir, args.preset, args.seed, family=args.family))


if __name__ == "__main__":
    main()
