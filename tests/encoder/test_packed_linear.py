"""Packed bfloat16 linear layers (encoder.models.linear) against F.linear, and what packing leaves unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from encoder.models import build_vision_tower
from encoder.models import linear as packing
from encoder.models.linear import PackedLinear, pack_linears
from encoder.pipeline import vision_fingerprint
from lm_engine import LLM, SamplingParams
from tests.support import image_part, make_image, user

NATIVE = packing.native_bf16()
needs_native = pytest.mark.skipif(
    not NATIVE,
    reason="oneDNN has no native bfloat16 on this CPU: nothing is packed here (test_what_is_not_packed checks that)",
)


@pytest.fixture
def always_faster(monkeypatch):
    """The packing decision without the timing: what a machine where packed calls are faster does."""
    monkeypatch.setattr(packing, "packed_is_faster", lambda: True)


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_packed_equals_f_linear_bit_for_bit(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(384, 1152, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin)
    x = torch.randn(rows, 384).to(torch.bfloat16)
    strided = torch.randn(384, rows).to(torch.bfloat16).t()  # not contiguous
    batched = torch.randn(2, rows, 384).to(torch.bfloat16)
    with torch.no_grad():
        for inp in (x, strided, batched):
            assert torch.equal(packed(inp), F.linear(inp, lin.weight, lin.bias))
    assert torch.equal(packed.state_dict()["weight"], lin.weight.detach())


@needs_native
def test_packed_tower_encodes_and_fingerprints_as_before(tiny_ckpt, always_faster):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    plain = build_vision_tower(config, tiny_ckpt, dtype=torch.bfloat16)
    tower = build_vision_tower(config, tiny_ckpt, dtype=torch.bfloat16)
    linears = sum(isinstance(m, nn.Linear) for m in tower.modules())
    assert pack_linears(tower) == linears > 0
    assert not any(isinstance(m, nn.Linear) for m in tower.modules())
    grid = torch.tensor([[1, 8, 12], [1, 6, 4]])
    pixels = torch.randn(
        int(grid.prod(-1).sum()), tower.cfg.patch_dim, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(tower(pixels, grid), plain(pixels, grid))
    # the embedding cache's key: what a replica that does not pack computes
    assert vision_fingerprint(tower) == vision_fingerprint(plain)


@needs_native
def test_engine_generates_the_same_ids_packed(tiny_ckpt, always_faster, monkeypatch):
    convs = [
        user("What is in the picture?", image_part(make_image(180, 120, 3))),
        user("Count to ten, slowly and in words."),
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def ids(switch: str) -> list[list[int]]:
        monkeypatch.setenv("VLMSERVE_PACKED_LINEAR", switch)
        with LLM(str(tiny_ckpt), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64) as llm:
            packed = sum(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
            assert (packed > 0) == (switch == "1")
            return [o.outputs[0].token_ids for o in llm.chat(convs, params)]

    assert ids("1") == ids("0")


def test_what_is_not_packed(monkeypatch, always_faster):
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    assert pack_linears(model) == 0  # float32: F.linear is already MKL's
    model.to(torch.bfloat16)
    monkeypatch.setenv("VLMSERVE_PACKED_LINEAR", "0")
    assert pack_linears(model) == 0
    monkeypatch.delenv("VLMSERVE_PACKED_LINEAR")
    monkeypatch.setattr(packing, "packed_is_faster", lambda: False)
    assert pack_linears(model) == 0
    monkeypatch.setattr(packing, "packed_is_faster", lambda: True)
    monkeypatch.setattr(packing, "native_bf16", lambda: False)
    assert pack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in (model[0], model[2]))
    if NATIVE:
        monkeypatch.setattr(packing, "native_bf16", lambda: True)
        assert pack_linears(model) == 2
        assert all(type(m) is PackedLinear for m in (model[0], model[2]))
