"""Our Qwen2.5-VL tower against transformers' on the same pixels: window attention with grids that are not a
multiple of the window, full attention at fullatt_block_indexes, packed batches against each image alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from encoder.models import build_vision_tower
from encoder.models.qwen2_5_vl import window_order
from runtime import cpu_kernel
from tests.encoder.test_towers import pixels_for, randomize

KERNEL = cpu_kernel.load() is not None
ATTENTIONS = [
    "torch",
    pytest.param("cpu-kernel", marks=pytest.mark.skipif(not KERNEL, reason="no C compiler")),
]
# In patches; the window is 8 patches (112 px): exact multiples, ragged edges on one or both sides, smaller
# than one window, and a grid of one merge unit.
GRIDS = [(1, 16, 16), (1, 10, 22), (1, 6, 4), (1, 18, 8), (1, 2, 2)]


def write_checkpoint(path: Path, hf, out: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    vc = hf.config
    config = {
        "model_type": "qwen2_5_vl",
        "hidden_size": out,
        "vision_config": {
            "depth": vc.depth,
            "hidden_size": vc.hidden_size,
            "intermediate_size": vc.intermediate_size,
            "num_heads": vc.num_heads,
            "out_hidden_size": out,
            "hidden_act": "silu",
            "in_chans": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": vc.window_size,
            "fullatt_block_indexes": list(vc.fullatt_block_indexes),
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file({f"visual.{k}": v.contiguous() for k, v in hf.state_dict().items()}, path / "model.safetensors")
    return path


@pytest.fixture(scope="module", params=[(64, 4, 3, (1,)), (160, 2, 3, (0, 2))], ids=str)
def hf_and_ckpt(request, tmp_path_factory):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    embed, heads, depth, full = request.param
    cfg = Qwen2_5_VLVisionConfig(
        depth=depth,
        hidden_size=embed,
        intermediate_size=embed * 2 + 16,
        num_heads=heads,
        out_hidden_size=48,
        window_size=112,
        fullatt_block_indexes=list(full),
    )
    cfg._attn_implementation = "sdpa"
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.float32).eval()
    randomize(hf, seed=embed + 1)
    return hf, write_checkpoint(tmp_path_factory.mktemp("tower25"), hf, 48)


def test_window_order_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    grids = [(1, 16, 16), (1, 10, 22), (2, 6, 4), (1, 2, 2)]
    want_index, want_cu = get_vision_window_index(torch.tensor(grids), 2, 112, 14)
    units, lengths = window_order(grids, 2, 4)
    assert torch.equal(units, want_index)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) * 4
    assert torch.equal(cu.int(), want_cu)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_tower_equals_transformers(hf_and_ckpt, attention):
    hf, ckpt = hf_and_ckpt
    ours = build_vision_tower(json.loads((ckpt / "config.json").read_text()), ckpt, attention=attention)
    pixels, grid = pixels_for(GRIDS, seed=11)
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid).pooler_output
    got = ours(pixels, grid)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_batch_equals_each_image_alone(hf_and_ckpt, attention):
    _, ckpt = hf_and_ckpt
    ours = build_vision_tower(json.loads((ckpt / "config.json").read_text()), ckpt, attention=attention)
    pixels, grid = pixels_for(GRIDS, seed=12)
    ours.rows_per_pass = 0  # every image in one packed pass
    packed = ours(pixels, grid)
    start, rows = 0, 0
    for t, h, w in GRIDS:
        alone = ours(pixels[start : start + t * h * w], torch.tensor([[t, h, w]]))
        # NOTE: the BLAS picks its kernel by row count, so a row's float32 sums need not round the same
        # packed as alone (an AMX Xeon differs by 1.2e-5): the tolerance against transformers' tower.
        torch.testing.assert_close(packed[rows : rows + alone.shape[0]], alone, atol=3e-5, rtol=3e-5)
        start, rows = start + t * h * w, rows + alone.shape[0]


def test_tower_on_the_float32_kernel_equals_transformers(hf_and_ckpt, monkeypatch):
    """The AVX2 build's float32 linear layers, forced (whatever this CPU's timing says), with the gated MLP's gate,
    up and silu · up in one pass of the kernel: still transformers' tower within float32 tolerance."""
    from runtime import linear as packing
    from tests.runtime.test_packed_linear import V3

    if not cpu_kernel.has_linear(V3):
        pytest.skip("not an x86-64 CPU with AVX2 and FMA (the float32 linear's build)")
    monkeypatch.setattr(packing, "kernel_linear_is_faster", lambda: True)
    monkeypatch.setattr(cpu_kernel, "load", lambda march="native": V3)
    fused = []
    glu = cpu_kernel.linear_glu
    monkeypatch.setattr(cpu_kernel, "linear_glu", lambda *a, **kw: fused.append(1) or glu(*a, **kw))
    hf, ckpt = hf_and_ckpt
    ours = build_vision_tower(json.loads((ckpt / "config.json").read_text()), ckpt, attention="cpu-kernel")
    assert packing.pack_linears(ours) > 0
    pixels, grid = pixels_for(GRIDS, seed=13)
    with torch.no_grad():
        want = hf(pixels, grid_thw=grid).pooler_output
    got = ours(pixels, grid)
    assert len(fused) == hf.config.depth  # every block's MLP took the one-pass path
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
