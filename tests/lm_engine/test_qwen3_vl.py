"""Qwen3-VL: the generated checkpoint loads in transformers, and our engine's greedy ids equal its generate()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from lm_engine.models.qwen3_vl_make import PRESETS, param_count
from tests.support import HFOracle, image_part, make_image, user

MAX_NEW = 20


@pytest.fixture(scope="module")
def oracle(qwen3_tiny_ckpt: Path) -> HFOracle:
    return HFOracle(qwen3_tiny_ckpt)


# -- the generated checkpoint ---------------------------------------------------------------------------
def test_checkpoint_loads_in_transformers(qwen3_tiny_ckpt: Path, oracle: HFOracle) -> None:
    model, info = AutoModelForImageTextToText.from_pretrained(
        qwen3_tiny_ckpt, local_files_only=True, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and model.dtype == torch.float32
    assert type(oracle.processor).__name__ == "Qwen3VLProcessor"
    text, vision = model.config.text_config, model.config.vision_config
    p = PRESETS["tiny"]
    assert text.head_dim == p.head_dim != text.hidden_size // text.num_attention_heads
    assert text.rope_parameters["mrope_interleaved"] is True
    assert text.rope_parameters["mrope_section"] == list(p.mrope_section)
    assert vision.patch_size == 16 and list(vision.deepstack_visual_indexes) == list(
        p.deepstack_visual_indexes
    )
    pre = json.loads((qwen3_tiny_ckpt / "preprocessor_config.json").read_text())
    assert pre["patch_size"] == 16 and pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]
    # The processor's placeholders: 32 px per merged token.
    inputs = oracle.inputs(user(image_part(make_image(224, 160, 1)), "Hi"))
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 14]]  # (t, h, w); the image is 224 wide
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 14 * 10 // 4


def test_small_preset_is_about_100m_parameters() -> None:
    assert 80e6 < param_count("small") < 150e6


def test_outputs_vary_with_prompt_and_image(oracle: HFOracle) -> None:
    """Random weights that ignore the image or the prompt would make the equivalence tests prove nothing."""
    texts = [oracle.generate(user(t), MAX_NEW) for t in ("Hi", "Tell me a story", "What is the time?")]
    assert len({tuple(t) for t in texts}) == 3
    images = [oracle.generate(user(image_part(make_image(224, 224, s)), "What?"), MAX_NEW) for s in (1, 2, 3)]
    assert len({tuple(t) for t in images}) == 3
