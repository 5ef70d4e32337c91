"""The generated Qwen2-VL checkpoints load in transformers like a real one and behave non-degenerately."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, Qwen2VLConfig

from tools.qwen2_vl_make import PRESETS, SPECIAL_TOKENS, make_checkpoint, param_count, token_ids

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@contextmanager
def _transformers_warnings() -> Iterator[list[str]]:
    """Collects transformers' logged warnings (its logger does not propagate) and Python warnings."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages.extend(str(w.message) for w in caught)
    finally:
        root.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)


def _load(path: Path):
    with _transformers_warnings() as logged:
        model, info = AutoModelForImageTextToText.from_pretrained(
            path, local_files_only=True, output_loading_info=True
        )
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    return model.eval(), processor, info, logged


@pytest.fixture(scope="module")
def tiny(tiny_ckpt: Path):
    return _load(tiny_ckpt)


def test_config_is_original_flat_layout(tiny_ckpt: Path) -> None:
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    ids = token_ids("tiny")
    assert cfg["architectures"] == ["Qwen2VLForConditionalGeneration"] and cfg["model_type"] == "qwen2_vl"
    assert "text_config" not in cfg and cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
    assert cfg["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert cfg["image_token_id"] == ids["<|image_pad|>"] and cfg["video_token_id"] == ids["<|video_pad|>"]
    assert cfg["vision_start_token_id"] == ids["<|vision_start|>"]
    assert cfg["vision_end_token_id"] == ids["<|vision_end|>"]
    assert cfg["vision_config"]["hidden_act"] == "quick_gelu" and cfg["vision_config"]["hidden_size"] == 64

    parsed = Qwen2VLConfig.from_pretrained(tiny_ckpt)  # v5 moves the flat text keys into text_config
    text = parsed.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (64, 2, 4)
    assert text.vocab_size == PRESETS["tiny"].vocab_size and text.rms_norm_eps == 1e-6
    assert text.rope_parameters["mrope_section"] == [2, 3, 3]
    assert text.rope_parameters["rope_theta"] == PRESETS["tiny"].rope_theta
    assert parsed.vision_config.embed_dim == 32 and parsed.vision_config.depth == 2
    assert parsed.tie_word_embeddings is False


def test_weights_use_original_key_names(tiny_ckpt: Path) -> None:
    with safe_open(tiny_ckpt / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert not any("language_model" in k or k.startswith("model.visual") for k in keys)
    expected = {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "visual.patch_embed.proj.weight",
    }
    expected |= {f"visual.merger.{m}.{p}" for m in ("ln_q", "mlp.0", "mlp.2") for p in ("weight", "bias")}
    for i in range(2):
        expected |= {f"model.layers.{i}.self_attn.{m}_proj.{p}" for m in "qkv" for p in ("weight", "bias")}
        expected |= {f"model.layers.{i}.self_attn.o_proj.weight"}
        expected |= {f"model.layers.{i}.mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        expected |= {f"model.layers.{i}.{n}_layernorm.weight" for n in ("input", "post_attention")}
        for m in ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
            expected |= {f"visual.blocks.{i}.{m}.weight", f"visual.blocks.{i}.{m}.bias"}
    assert keys == expected


def test_loads_offline_without_warnings(tiny) -> None:
    model, processor, info, logged = tiny
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert logged == []
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration" and model.dtype == torch.float32
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    ids = token_ids("tiny")
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert model.generation_config.do_sample is False


def test_tokenizer(tiny_ckpt: Path) -> None:
    from tokenizers import Tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpt, local_files_only=True)
    ids = token_ids("tiny")
    first = PRESETS["tiny"].vocab_size - len(SPECIAL_TOKENS)
    assert list(ids.values()) == list(range(first, PRESETS["tiny"].vocab_size))
    assert len(tok) == PRESETS["tiny"].vocab_size
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(ids.values())
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Hello wörld, it's 2024: café 中文 🙂\n<|im_start|>user\n<|image_pad|><|im_end|>"
    enc = tok(text)["input_ids"]
    assert tok.decode(enc) == text
    assert enc[-2:] == [ids["<|image_pad|>"], ids["<|im_end|>"]]
    # The raw tokenizer.json (what the engine may load directly) agrees with transformers' class.
    assert Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json")).encode(text).ids == enc
    # Byte-level BPE learned whole multi-byte characters, so detokenizers see split and whole UTF-8.
    learned = [tok.decode([i]) for i in range(first)]
    assert any(any(ord(c) > 127 for c in s) and "\ufffd" not in s for s in learned)
    assert any("\ufffd" in s for s in learned)


def test_chat_template(tiny) -> None:
    _, processor, _, _ = tiny
    tok = processor.tokenizer

    def render(messages: list[dict], prompt: bool = True) -> str:
        out = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert out == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        return out

    assert render([{"role": "user", "content": "Hi"}]) == (
        SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
        {"type": "text", "text": "compare"},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "Same."}]},
    ]
    assert render(messages, prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{VISION}and{VISION}compare<|im_end|>\n"
        "<|im_start|>assistant\nSame.<|im_end|>\n"
    )
    ckpt = Path(tok.name_or_path)
    assert json.loads((ckpt / "chat_template.json").read_text())["chat_template"] == processor.chat_template
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"] == tok.chat_template


def test_image_processor_respects_pixel_limits(tiny) -> None:
    _, processor, _, _ = tiny
    p = PRESETS["tiny"]
    grids = {}
    for w, h in [(1024, 768), (4096, 3072), (20, 20)]:
        out = processor.image_processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")
        t, gh, gw = out["image_grid_thw"][0].tolist()
        assert t == 1 and gh % 2 == 0 and gw % 2 == 0
        assert p.min_pixels <= gh * gw * 14 * 14 <= p.max_pixels
        assert out["pixel_values"].shape == (gh * gw, 3 * 2 * 14 * 14)
        grids[w, h] = gh, gw
    assert grids[1024, 768] == (54, 74)  # within the limits each side rounds to a multiple of 28
    assert grids[4096, 3072][0] * grids[4096, 3072][1] * 196 > 0.8 * p.max_pixels  # shrunk to the cap


def _greedy(model, processor, text: str, image: Image.Image | None = None) -> tuple[list[int], list[float]]:
    content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=[prompt], images=[image] if image is not None else None, return_tensors="pt")
    if image is not None:
        grid = inputs["image_grid_thw"][0]
        n_pad = int((inputs["input_ids"] == model.config.image_token_id).sum())
        assert n_pad == int(grid.prod()) // 4
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=24, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
    new = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    gaps = [float(v[0] - v[1]) for v in (s[0].topk(2).values for s in out.scores)]
    return new, gaps


def _images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    gradient = np.tile(np.linspace(0, 255, 224, dtype=np.uint8)[None, :, None], (224, 1, 3))
    return {
        "noise56": Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)),
        "gradient224": Image.fromarray(gradient),
        "red224": Image.new("RGB", (224, 224), (255, 0, 0)),
        "blue224": Image.new("RGB", (224, 224), (0, 0, 255)),  # same token count as red: content matters
    }


def test_greedy_generation_is_not_degenerate(tiny) -> None:
    model, processor, _, _ = tiny
    eos = set(model.generation_config.eos_token_id)
    texts = ["Hello, how are you?", "What is the capital of France?", "Describe the picture."]
    runs = {t: _greedy(model, processor, t) for t in texts}
    runs |= {k: _greedy(model, processor, "Describe the picture.", im) for k, im in _images().items()}
    outputs = {k: tuple(new) for k, (new, _) in runs.items()}
    assert len(set(outputs.values())) == len(outputs), outputs  # (a) per prompt, (b) per image
    for key, (new, gaps) in runs.items():
        assert len(set(new)) >= 4, (key, new)  # (c)
        assert not eos & set(new[:4]), (key, new)  # (d)
        assert min(gaps) > 1e-3, (key, gaps)  # no near-ties for fp32 rounding to flip
    all_gaps = [g for _, gaps in runs.values() for g in gaps]
    assert np.median(all_gaps) > 0.3


def test_same_seed_same_bytes_other_seed_other_weights(tiny_ckpt: Path, tmp_path: Path) -> None:
    again = make_checkpoint(tmp_path / "again", "tiny", seed=0)
    names = sorted(p.name for p in tiny_ckpt.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_ckpt / name).read_bytes() == (again / name).read_bytes(), name

    other = make_checkpoint(tmp_path / "other", "tiny", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_ckpt / "tokenizer.json").read_bytes()
    a, b = load_file(tiny_ckpt / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys() and all(not torch.equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, "tiny", seed=0, shard_size_bytes=400_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    merged = {k: v for s in shards for k, v in load_file(out / s).items()}
    whole = load_file(tiny_ckpt / "model.safetensors")
    assert merged.keys() == whole.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    _, _, info, logged = _load(out)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]) and logged == []

    make_checkpoint(tmp_path, "tiny", seed=0)  # overwriting drops the stale shards and index
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_small_preset_size() -> None:
    p = PRESETS["small"]
    assert p.dtype == "bfloat16" and p.hidden_size // p.num_heads == 2 * sum(p.mrope_section)
    n = param_count("small")
    print(f"small preset: {n / 1e6:.1f}M parameters")
    assert 70e6 < n < 130e6


@pytest.mark.slow
def test_small_checkpoint_loads(tmp_path: Path) -> None:
    out = make_checkpoint(tmp_path, "small", seed=0)
    model, processor, info, logged = _load(out)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]) and logged == []
    assert model.dtype == torch.bfloat16 and len(processor.tokenizer) == PRESETS["small"].vocab_size
    assert sum(t.numel() for t in model.parameters()) == param_count("small")
