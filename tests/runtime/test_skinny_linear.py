"""The few-row bfloat16 kernel (runtime/csrc/skinny_linear.c) on oneDNN's packed buffer: its layout, its
products against float64 and against oneDNN's own call on the same buffer, and when PackedLinear takes it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lm_engine import LLM, SamplingParams
from runtime import linear as packing
from runtime.linear import SKINNY_ROWS, PackedLinear
from tests.support import image_part, make_image, user

FOUND = packing.skinny_library()
# (path, block): every path the library runs here, on the layout it reads
PATHS = [] if FOUND is None else [(2, 32), (3, 64)] + ([(1, 32)] if FOUND[1] == "amx" else [])
PATH_IDS = {1: "amx", 2: "bf16dot32", 3: "bf16dot64"}
needs_kernel = pytest.mark.skipif(
    FOUND is None,
    reason="no AVX512-BF16 or no compiler here: the kernel is not built (test_off_switch checks that)",
)
NATIVE = packing.native_bf16()


def vnni(weight: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The kernel's layout [n/B][k/2][B][2], built here from the plain weight: the oracle for oneDNN's."""
    n, k = weight.shape
    return weight.view(n // block, block, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def close_to_bf16(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one bfloat16 rounding of the float64 product, plus float32 accumulation's error."""
    err = (y.double() - ref).abs()
    bound = ref.abs() * 2.0**-8 + 1e-3 * ref.abs().max()
    assert bool((err <= bound).all()), f"worst error {err.max().item():.3g}"


@needs_kernel
@pytest.mark.parametrize("path_block", PATHS, ids=lambda p: PATH_IDS[p[0]])
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"),
    [
        (1, 64, 32, False),
        (3, 192, 160, True),
        (5, 64, 1024, False),
        (8, 128, 1024, False),
        (9, 448, 96, True),
        (16, 2048, 1536, True),
    ],
)
def test_kernel_matches_float64_on_its_layout(path_block, rows, n, k, bias):
    path, block = path_block
    torch.manual_seed(rows * n + k)
    weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    b = (torch.randn(n) * 0.5).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    words = vnni(weight, block)
    y = packing.skinny_call(x, words.data_ptr(), n, b, path)
    close_to_bf16(y, reference(x, weight, b))
    # rows apart by more than k (a slice of a wider tensor), and a batch of rows in leading dimensions
    wide = torch.randn(rows, k + 64).to(torch.bfloat16)[:, 32 : 32 + k]
    close_to_bf16(packing.skinny_call(wide, words.data_ptr(), n, b, path), reference(wide, weight, b))
    batched = x.view(1, rows, k)
    assert torch.equal(packing.skinny_call(batched, words.data_ptr(), n, b, path), y.view(1, rows, n))


@needs_kernel
@pytest.mark.skipif(not NATIVE, reason="oneDNN has no native bfloat16 here: nothing is packed")
def test_onednn_packs_the_layout_the_kernel_reads_or_the_kernel_is_not_used():
    torch.manual_seed(0)
    weight = torch.randn(2048, 1536).to(torch.bfloat16)
    words = packing.packed_words(torch.ops.mkldnn._reorder_linear_weight(weight, None))
    same = {
        block: words is not None and torch.equal(words, vnni(weight, block).view(torch.int16).reshape(-1))
        for block in packing.SKINNY_BLOCKS
    }
    # what the sampled check and the once-a-process check say must be what the whole buffer shows
    for block, matches in same.items():
        assert packing.vnni_layout(weight, words, block) == matches
    found = [block for block, matches in same.items() if matches]
    assert packing.skinny_layout_block() == (found[0] if found else 0)
    # a buffer in another order is refused, and a shape the layout cannot hold is not taken
    shuffled = weight.t().contiguous().view(torch.int16).reshape(-1)
    for block in packing.SKINNY_BLOCKS:
        assert not packing.vnni_layout(weight, shuffled, block)
        assert not packing.vnni_layout(weight, words[:-32] if words is not None else None, block)


@needs_kernel
@pytest.mark.skipif(
    FOUND is None or FOUND[1] != "amx", reason="AMX: the path whose products are oneDNN's own"
)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_amx_path_equals_onednn_on_the_same_buffer_bit_for_bit(rows, monkeypatch):
    monkeypatch.setattr(packing, "skinny_is_faster", lambda: True)
    torch.manual_seed(rows)
    lin = nn.Linear(1536, 2048, bias=True).to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.skinny == 1
    x = torch.randn(rows, 1536).to(torch.bfloat16)
    ours = packed(x)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed.packed, packed.bias, "none", [], "")
    assert torch.equal(ours, onednn)
    assert torch.equal(ours, F.linear(x, lin.weight, lin.bias))


@needs_kernel
@pytest.mark.skipif(not NATIVE, reason="oneDNN has no native bfloat16 here: nothing is packed")
def test_packed_linear_takes_the_kernel_for_few_rows_only(monkeypatch):
    monkeypatch.setattr(packing, "skinny_is_faster", lambda: True)
    if not packing.skinny_layout_block():
        pytest.skip("oneDNN packs another layout on this CPU: the kernel is never taken here")
    calls = []
    real = packing.skinny_call
    monkeypatch.setattr(packing, "skinny_call", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(1)
    lin = nn.Linear(256, 512, bias=False).to(torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.skinny == packing.skinny_code(FOUND[1], packing.skinny_layout_block())
    assert packed.skinny in (1, 2, 3)
    with torch.no_grad():
        for rows in (1, SKINNY_ROWS, SKINNY_ROWS + 1, 64):
            x = torch.randn(rows, 256).to(torch.bfloat16)
            close_to_bf16(packed(x), reference(x, lin.weight, None))
        assert calls == [(1, 256), (SKINNY_ROWS, 256)]
        # nothing to compute, and float32 input, stay with oneDNN's call
        assert packed(torch.zeros(0, 256, dtype=torch.bfloat16)).shape == (0, 512)
        assert len(calls) == 2
    # shapes the layout cannot hold are not taken
    assert PackedLinear(nn.Linear(256, 48).to(torch.bfloat16)).skinny == 0
    assert PackedLinear(nn.Linear(256, 96).to(torch.bfloat16)).skinny in (0, 1, 2)  # not 64-blocks
    assert PackedLinear(nn.Linear(176, 64).to(torch.bfloat16)).skinny == 0


@needs_kernel
def test_kernel_refuses_what_it_cannot_do():
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    words = vnni(weight)
    with pytest.raises(RuntimeError, match="refused"):
        packing.skinny_call(
            torch.zeros(SKINNY_ROWS + 1, 64, dtype=torch.bfloat16), words.data_ptr(), 64, None, 2
        )
    with pytest.raises(RuntimeError, match="refused"):
        packing.skinny_call(torch.zeros(1, 48, dtype=torch.bfloat16), words.data_ptr(), 64, None, 2)
    with pytest.raises(RuntimeError, match="refused"):
        packing.skinny_call(torch.zeros(1, 64, dtype=torch.bfloat16), words.data_ptr(), 64, None, 7)
    with pytest.raises(RuntimeError, match="refused"):  # 64-output blocks: n = 96 holds none whole
        packing.skinny_call(torch.zeros(1, 64, dtype=torch.bfloat16), words.data_ptr(), 96, None, 3)


def test_paths_follow_isa_and_block():
    assert packing.skinny_code("amx", 32) == 1
    assert packing.skinny_code("avx512-bf16", 32) == 2
    assert packing.skinny_code("avx512-bf16", 64) == 3
    assert packing.skinny_code("amx", 64) == 3  # AMX tiles read 32-blocks only: the dot products read 64
    assert packing.skinny_code("avx512-bf16", 16) == 0


def test_off_switch(monkeypatch):
    monkeypatch.setenv("VLMSERVE_SKINNY_LINEAR", "0")
    packing.skinny_library.cache_clear()
    try:
        assert packing.skinny_library() is None
        if NATIVE:
            assert PackedLinear(nn.Linear(64, 64).to(torch.bfloat16)).skinny == 0
    finally:
        packing.skinny_library.cache_clear()


@needs_kernel
@pytest.mark.skipif(not NATIVE, reason="oneDNN has no native bfloat16 here: nothing is packed")
def test_engine_generates_the_same_ids_with_the_kernel(tiny_ckpt, monkeypatch):
    """The tiny decoder's projections (all but its 176 → 64 down projection) on the kernel in decode steps:
    greedy ids equal to the same engine's with the kernel off (the AMX path's products are oneDNN's own)."""
    monkeypatch.setattr(packing, "packed_is_faster", lambda: True)
    monkeypatch.setattr(packing, "skinny_is_faster", lambda: True)
    if not packing.skinny_layout_block():
        pytest.skip("oneDNN packs another layout on this CPU: the kernel is never taken here")
    convs = [
        user("What is in the picture?", image_part(make_image(180, 120, 3))),
        user("Count to ten, slowly and in words."),
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ids = {}
    for on in (True, False):
        with LLM(str(tiny_ckpt), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64) as llm:
            layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
            block = packing.skinny_layout_block()
            fits = [m for m in layers if m.out_features % block == 0 and m.in_features % 32 == 0]
            assert (
                len(fits) >= len(layers) - 4
            )  # the down projections (176 → 64), and 352-wide gate/up on 64s
            assert all(m.skinny for m in fits)
            if not on:
                for m in layers:
                    m.skinny = 0
            ids[on] = [o.outputs[0].token_ids for o in llm.chat(convs, params)]
    if FOUND[1] == "amx":
        assert ids[True] == ids[False]
    else:  # other products than oneDNN's: the first steps agree
        assert [t[:4] for t in ids[True]] == [t[:4] for t in ids[False]]
