"""The family registry: each checkpoint reads into its own config class and builds its own decoder, although
Qwen3-VL's config is a subclass of Qwen2-VL's; the fields equal what transformers reads from the same file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from lm_engine.models.qwen2_vl import Qwen2VLConfig, Qwen2VLDecoder
from lm_engine.models.qwen3_vl import Qwen3VLConfig, Qwen3VLDecoder
from lm_engine.models.registry import build_decoder, load_model_config

FAMILIES = [
    ("tiny_ckpt", Qwen2VLConfig, Qwen2VLDecoder),
    ("tiny25_ckpt", Qwen2VLConfig, Qwen2VLDecoder),
    ("qwen3_tiny_ckpt", Qwen3VLConfig, Qwen3VLDecoder),
]


@pytest.mark.parametrize(("ckpt", "config_cls", "decoder_cls"), FAMILIES)
def test_each_family_gets_its_own_config_and_decoder(request, ckpt, config_cls, decoder_cls) -> None:
    cfg = load_model_config(request.getfixturevalue(ckpt))
    assert type(cfg) is config_cls
    # NOTE: a Qwen3VLConfig is also a Qwen2VLConfig: the first isinstance match would build Qwen2-VL's decoder
    assert type(build_decoder(cfg)) is decoder_cls


def test_a_later_subclass_gets_its_nearest_familys_decoder(qwen3_tiny_ckpt: Path) -> None:
    class LaterConfig(Qwen3VLConfig):
        pass

    assert type(build_decoder(LaterConfig.from_dir(qwen3_tiny_ckpt))) is Qwen3VLDecoder


def test_each_config_refuses_the_other_familys_checkpoint(tiny_ckpt: Path, qwen3_tiny_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="is not a Qwen3-VL checkpoint"):
        Qwen3VLConfig.from_dir(tiny_ckpt)
    with pytest.raises(ValueError, match="is not a Qwen2-VL or Qwen2.5-VL checkpoint"):
        Qwen2VLConfig.from_dir(qwen3_tiny_ckpt)


@pytest.mark.parametrize(("ckpt", "config_cls", "decoder_cls"), FAMILIES)
def test_fields_equal_transformers_reading(request, ckpt, config_cls, decoder_cls) -> None:
    path = request.getfixturevalue(ckpt)
    ours, theirs = load_model_config(path), AutoConfig.from_pretrained(path, local_files_only=True)
    text = theirs.text_config
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert getattr(ours, name) == getattr(text, name), name
    assert ours.rope_theta == text.rope_parameters["rope_theta"]
    assert ours.mrope_section == text.rope_parameters["mrope_section"]
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.image_token_id == theirs.image_token_id
    assert ours.vision_start_token_id == theirs.vision_start_token_id
    if config_cls is Qwen3VLConfig:
        assert ours.head_dim == text.head_dim != ours.hidden_size // ours.num_attention_heads
        assert ours.attention_bias == text.attention_bias
        assert ours.mrope_interleaved == text.rope_parameters["mrope_interleaved"]
        assert ours.deepstack_levels == len(theirs.vision_config.deepstack_visual_indexes)


def test_qwen3_defaults_are_its_own(qwen3_tiny_ckpt: Path, tmp_path: Path) -> None:
    """Where config.json is silent, a Qwen3-VL config takes Qwen3-VL's defaults, not its base's."""
    bare = tmp_path / "bare"
    shutil.copytree(qwen3_tiny_ckpt, bare)
    raw = json.loads((bare / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings"):
        raw["text_config"].pop(key, None)
    raw["vision_config"].pop("deepstack_visual_indexes")
    (bare / "config.json").write_text(json.dumps(raw))
    ours, theirs = Qwen3VLConfig.from_dir(bare), AutoConfig.from_pretrained(bare, local_files_only=True)
    assert ours.max_position_embeddings == theirs.text_config.max_position_embeddings != 32768
    assert ours.deepstack_levels == len(theirs.vision_config.deepstack_visual_indexes)
    assert ours.mrope_section == [24, 20, 20]  # the published Qwen3-VL checkpoints' bands (head_dim 128)
    assert ours.rope_theta == Qwen3VLConfig.default_rope_theta != Qwen2VLConfig.default_rope_theta
