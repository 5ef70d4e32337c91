"""Our vision towers against transformers' own modules on the same pixels, packed batches against each image
alone, and the weight loader (single file and sharded index)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from encoder.models import build_vision_tower
from encoder.models.base import pass_groups
from runtime import cpu_kernel

KERNEL = cpu_kernel.load() is not None
ATTENTIONS = [
    "torch",
    pytest.param("cpu-kernel", marks=pytest.mark.skipif(not KERNEL, reason="no C compiler")),
]
# Grids (t, h, w) in patches: square, wide, tall, the smallest, one larger than a 64-row kernel block.
GRIDS = [(1, 8, 8), (1, 4, 10), (1, 14, 6), (1, 2, 2), (1, 16, 12)]


def hf_vision_config(embed: int, heads: int, depth: int, out: int):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    return Qwen2VLVisionConfig(
        depth=depth, embed_dim=embed, num_heads=heads, hidden_size=out, mlp_ratio=4, hidden_act="quick_gelu"
    )


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights loud enough that attention depends on content and position (transformers' 0.02 init is
    nearly uniform attention, which would hide position and masking bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                scale = 2.0 if ".qkv." in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale / fan_in**0.5)


def write_tower_checkpoint(path: Path, hf_tower, out: int, shards: int = 1) -> Path:
    """A checkpoint directory holding only a Qwen2-VL tower's ``visual.*`` tensors (and a decoy tensor)."""
    path.mkdir(parents=True, exist_ok=True)
    vc = hf_tower.config
    config = {
        "model_type": "qwen2_vl",
        "hidden_size": out,
        "vision_config": {
            "depth": vc.depth,
            "embed_dim": vc.embed_dim,
            "num_heads": vc.num_heads,
            "hidden_size": out,
            "mlp_ratio": vc.mlp_ratio,
            "hidden_act": vc.hidden_act,
            "in_chans": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {f"visual.{k}": v.contiguous() for k, v in hf_tower.state_dict().items()}
    tensors["model.embed_tokens.weight"] = torch.zeros(4, out)  # the decoder's: the tower must skip it
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, path / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.fixture(scope="module", params=[(64, 4, 2, 48), (128, 2, 2, 96), (160, 2, 1, 64)], ids=str)
def hf_and_ckpt(request, tmp_path_factory):
    """(transformers' tower, a checkpoint of it): head_dim 16 (the tiny preset's), 64 (small's), 80 (the
    real Qwen2-VL's); the second one in a sharded checkpoint."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    embed, heads, depth, out = request.param
    cfg = hf_vision_config(embed, heads, depth, out)
    cfg._attn_implementation = "sdpa"
    hf = Qwen2VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.float32).eval()
    randomize(hf, seed=embed)
    shards = 3 if embed == 128 else 1
    return hf, write_tower_checkpoint(tmp_path_factory.mktemp("tower"), hf, out, shards)


def pixels_for(grids: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=gen), torch.tensor(grids)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_tower_equals_transformers(hf_and_ckpt, attention):
    hf, ckpt = hf_and_ckpt
    ours = build_vision_tower(json.loads((ckpt / "config.json").read_text()), ckpt, attention=attention)
    assert ours.attend.name == attention
    pixels, grid = pixels_for(GRIDS, seed=1)
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid).pooler_output
    got = ours(pixels, grid)
    assert got.shape == want.shape == (pixels.shape[0] // 4, hf.config.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_batch_equals_each_image_alone(hf_and_ckpt, attention):
    _, ckpt = hf_and_ckpt
    ours = build_vision_tower(json.loads((ckpt / "config.json").read_text()), ckpt, attention=attention)
    pixels, grid = pixels_for(GRIDS, seed=2)
    ours.rows_per_pass = 0  # every image in one packed pass
    packed = ours(pixels, grid)
    start, rows = 0, 0
    for t, h, w in GRIDS:
        alone = ours(pixels[start : start + t * h * w], torch.tensor([[t, h, w]]))
        # NOTE: the BLAS picks its kernel by row count, so a row's float32 sums need not round the same
        # packed as alone (an AMX Xeon differs by 1.2e-5): the tolerance against transformers' tower.
        torch.testing.assert_close(packed[rows : rows + alone.shape[0]], alone, atol=2e-5, rtol=2e-5)
        start, rows = start + t * h * w, rows + alone.shape[0]
    assert rows == packed.shape[0]


def test_pass_groups():
    assert pass_groups([64, 40, 84, 4, 192], 0) == [(0, 5)]
    assert pass_groups([64, 40, 84, 4, 192], 128) == [(0, 2), (2, 4), (4, 5)]  # 192 > 128 runs alone
    assert pass_groups([64, 40, 84, 4, 192], 104) == [(0, 2), (2, 4), (4, 5)]  # exactly the budget fits
    assert pass_groups([200, 1], 100) == [(0, 1), (1, 2)]
    assert pass_groups([], 100) == [(0, 0)]


@pytest.mark.parametrize("budget", [100, 1])
def test_passes_under_a_row_budget_equal_one_packed_pass(hf_and_ckpt, budget):
    """The batch in passes of at most ``budget`` patches (1: an image per pass) gives one pass's rows, in
    order; the cut between passes is an image boundary, so the tolerance is the packed-vs-alone one."""
    _, ckpt = hf_and_ckpt
    ours = build_vision_tower(json.loads((ckpt / "config.json").read_text()), ckpt)
    pixels, grid = pixels_for(GRIDS, seed=4)
    ours.rows_per_pass = 0
    whole = ours(pixels, grid)
    ours.rows_per_pass = budget
    calls = []
    one_pass = ours.encode_pass
    ours.encode_pass = lambda p, g: calls.append(g.tolist()) or one_pass(p, g)
    torch.testing.assert_close(ours(pixels, grid), whole, atol=2e-5, rtol=2e-5)
    expected = [
        [list(GRIDS[i]) for i in range(a, b)] for a, b in pass_groups([h * w for _, h, w in GRIDS], budget)
    ]
    assert calls == expected and len(calls) > 1


def test_tiny_checkpoint_tower_equals_transformers(tiny_ckpt):
    """The generated test checkpoint, loaded by transformers the way the oracle loads it."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    config = json.loads((tiny_ckpt / "config.json").read_text())
    ours = build_vision_tower(config, tiny_ckpt)
    pixels, grid = pixels_for([(1, 6, 8), (1, 2, 4)], seed=3)
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=grid).pooler_output
    torch.testing.assert_close(ours(pixels, grid), want, atol=2e-5, rtol=2e-5)


def test_loader_names_what_is_wrong(hf_and_ckpt, tmp_path):
    hf, ckpt = hf_and_ckpt
    config = json.loads((ckpt / "config.json").read_text())
    broken = write_tower_checkpoint(tmp_path / "missing", hf, config["hidden_size"])
    from safetensors.torch import load_file

    tensors = load_file(broken / "model.safetensors")
    del tensors["visual.blocks.0.attn.qkv.bias"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.qkv\.bias"):
        build_vision_tower(config, broken, attention="torch")
    tensors["visual.blocks.0.attn.qkv.bias"] = torch.zeros(3 * config["vision_config"]["embed_dim"])
    tensors["visual.blocks.0.attn.extra"] = torch.zeros(3)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"visual\.blocks\.0\.attn\.extra"):
        build_vision_tower(config, broken, attention="torch")
    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        build_vision_tower(config, broken, attention="torch")


@pytest.mark.skipif(not KERNEL, reason="no C compiler")
def test_attention_choice_follows_the_environment(tiny_ckpt, monkeypatch):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    for name in ("cpu-kernel", "torch"):
        monkeypatch.setenv("VLMSERVE_VISION_ATTENTION", name)
        assert build_vision_tower(config, tiny_ckpt).attend.name == name
    monkeypatch.setenv("VLMSERVE_VISION_ATTENTION", "auto")
    assert build_vision_tower(config, tiny_ckpt).attend.name in ("cpu-kernel", "torch")
    assert (
        build_vision_tower(config, tiny_ckpt, attention="torch").attend.name == "torch"
    )  # the argument wins
