"""Our Qwen3-VL tower against transformers' Qwen3VLVisionModel on the same pixels: the main merged rows and
every deepstack level, packed batches against each image alone, and the generated tiny checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from encoder.models import Qwen3VisionTower, build_vision_tower
from runtime import cpu_kernel

ATTENTIONS = [
    "torch",
    pytest.param("cpu-kernel", marks=pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler")),
]

# (t, h, w) in patches: square, wide, tall, the smallest, larger than the 12×12 learned table, one frame pair.
GRIDS = [(1, 8, 8), (1, 4, 10), (1, 14, 6), (1, 2, 2), (1, 16, 20), (2, 6, 4)]
PATCH_DIM = 3 * 2 * 16 * 16


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Loud weights (transformers' 0.02 init hides position and masking bugs); the position table as loud
    as a patch embedding, so an interpolation bug changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name == "pos_embed.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                scale = 2.0 if ".qkv." in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale / fan_in**0.5)


def vision_config(hidden: int, heads: int, depth: int, out: int, deepstack: list[int], side: int) -> dict:
    return {
        "depth": depth,
        "hidden_size": hidden,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 3 * hidden,
        "num_heads": heads,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out,
        "num_position_embeddings": side * side,
        "deepstack_visual_indexes": deepstack,
    }


@pytest.fixture(
    scope="module",
    params=[(64, 4, 3, 48, [0, 2], 12), (128, 2, 4, 96, [1, 2, 3], 8), (80, 1, 2, 64, [], 16)],
    ids=str,
)
def hf_and_ckpt(request, tmp_path_factory):
    """(transformers' tower, a checkpoint of it): head_dim 16, 64 and 80; 2, 3 and no deepstack levels."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    hidden, heads, depth, out, deepstack, side = request.param
    vc = vision_config(hidden, heads, depth, out, deepstack, side)
    cfg = Qwen3VLVisionConfig(**vc)
    cfg._attn_implementation = "sdpa"
    hf = Qwen3VLVisionModel._from_config(cfg, dtype=torch.float32).eval()
    randomize(hf, seed=hidden)
    path = tmp_path_factory.mktemp("qwen3_tower")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": vc}))
    tensors = {f"model.visual.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(4, out)  # the decoder's, skipped
    save_file(tensors, path / "model.safetensors")
    return hf, path


def pixels_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed)), torch.tensor(grids)


def ours_for(path: Path, attention: str = "torch") -> Qwen3VisionTower:
    return build_vision_tower(json.loads((path / "config.json").read_text()), path, attention=attention)


def split_levels(rows: torch.Tensor, levels: int) -> list[torch.Tensor]:
    return list(rows.chunk(1 + levels, dim=-1))


@torch.no_grad()
def assert_equals_transformers(ours, hf, pixels, grid_thw) -> None:
    ref = hf(pixels, grid_thw=grid_thw)
    expected = [ref.pooler_output, *ref.deepstack_features]
    got = split_levels(ours(pixels, grid_thw), ours.levels)
    assert len(got) == len(expected) == 1 + len(hf.config.deepstack_visual_indexes)
    for level, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5, msg=f"level {level}")


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_tower_equals_transformers(hf_and_ckpt, attention):
    hf, path = hf_and_ckpt
    ours = ours_for(path, attention)
    assert ours.attend.name == attention
    assert isinstance(ours, Qwen3VisionTower) and ours.levels == len(hf.config.deepstack_visual_indexes)
    for i, grid in enumerate(GRIDS):
        assert_equals_transformers(ours, hf, *pixels_for([grid], seed=i))
    assert_equals_transformers(ours, hf, *pixels_for(GRIDS, seed=99))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_batch_equals_each_image_alone(hf_and_ckpt, attention):
    _, path = hf_and_ckpt
    ours = ours_for(path, attention)
    pixels, grid_thw = pixels_for(GRIDS, seed=7)
    packed = ours(pixels, grid_thw)
    alone, start = [], 0
    for grid in GRIDS:
        n = math.prod(grid)
        alone.append(ours(pixels[start : start + n], torch.tensor([grid])))
        start += n
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_position_table_matters(hf_and_ckpt):
    """Negative control: the same tower with its learned position table zeroed no longer matches."""
    hf, path = hf_and_ckpt
    ours = ours_for(path)
    with torch.no_grad():
        ours.pos_embed.weight.zero_()
    pixels, grid_thw = pixels_for([(1, 16, 20)], seed=3)
    with pytest.raises(AssertionError):
        assert_equals_transformers(ours, hf, pixels, grid_thw)


def test_tiny_checkpoint_tower_equals_transformers(qwen3_tiny_ckpt):
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(qwen3_tiny_ckpt), dtype=torch.float32).eval()
    ours = ours_for(qwen3_tiny_ckpt)
    assert ours.levels == 2
    for i, grid in enumerate([(1, 14, 10), (1, 4, 4)]):
        assert_equals_transformers(ours, hf.model.visual, *pixels_for([grid], seed=i))


def test_server_answers_qwen3_image_request_without_transformers_modeling(qwen3_tiny_ckpt):
    """`--model` takes a Qwen3-VL checkpoint: the server answers an image request through our tower and
    decoder, with no transformers modeling module imported."""
    from tests.encoder.test_serving_imports import SERVE_ONE_REQUEST
    from tests.support import run_fresh

    report = run_fresh(SERVE_ONE_REQUEST, str(qwen3_tiny_ckpt))
    assert report["status"] == 200, report["body"]
    assert report["patches"] and report["patches"][0] > 0
    assert report["modeling"] == []
