"""Packed linear layers (runtime.linear: oneDNN's bfloat16, our float32 kernel) against F.linear, and
what packing leaves unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from encoder.models import build_vision_tower
from encoder.pipeline import vision_fingerprint
from lm_engine import LLM, SamplingParams
from runtime import cpu_kernel
from runtime import linear as packing
from runtime.linear import KernelLinear, PackedLinear, pack_linears
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
def test_packed_equals_f_linear_bit_for_bit(rows, bias, monkeypatch):
    # oneDNN's call on the packed weight, whatever the start-up probe says of the few-row kernel here (its AMX
    # path is oneDNN's products to the bit, its dot-product paths add in another order: test_skinny_linear.py)
    monkeypatch.setattr(packing, "skinny_is_faster", lambda: False)
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


def _engine_ids(ckpt, dtype: str, check) -> list[list[int]]:
    """Greedy ids of two conversations (one with an image) through the engine; ``check(runner)`` first."""
    convs = [
        user("What is in the picture?", image_part(make_image(180, 120, 3))),
        user("Count to ten, slowly and in words."),
    ]
    with LLM(str(ckpt), dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=64) as llm:
        check(llm.engine.runner)
        return [
            o.outputs[0].token_ids for o in llm.chat(convs, SamplingParams(max_tokens=12, temperature=0.0))
        ]


@needs_native
def test_engine_generates_the_same_ids_packed(tiny_ckpt, always_faster, monkeypatch):
    def ids(switch: str) -> list[list[int]]:
        monkeypatch.setenv("VLMSERVE_PACKED_LINEAR", switch)

        def check(runner) -> None:
            packed = sum(isinstance(m, PackedLinear) for m in runner.model.modules())
            assert (packed > 0) == (switch == "1")

        return _engine_ids(tiny_ckpt, "bfloat16", check)

    assert ids("1") == ids("0")


def test_what_is_not_packed(monkeypatch, always_faster):
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    monkeypatch.setattr(packing, "kernel_linear_is_faster", lambda: False)
    assert pack_linears(model) == 0  # float32 where our kernel is no faster: F.linear stays
    monkeypatch.setattr(packing, "kernel_linear_is_faster", lambda: True)
    monkeypatch.setenv("VLMSERVE_KERNEL_LINEAR", "0")
    assert pack_linears(model) == 0
    monkeypatch.delenv("VLMSERVE_KERNEL_LINEAR")
    monkeypatch.setattr(packing, "kernel_linear_is_faster", lambda: False)
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


def _v3_library():
    """The library's AVX2 + FMA build (the one with the float32 linear) wherever this CPU runs it."""
    import platform

    from runtime.native import _cpu_flags

    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= set(_cpu_flags().split()):
        return None
    return cpu_kernel.load("x86-64-v3")


V3 = _v3_library()
needs_v3 = pytest.mark.skipif(
    not cpu_kernel.has_linear(V3), reason="not an x86-64 CPU with AVX2 and FMA (the float32 linear's build)"
)


@needs_v3
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("n,k", [(1152, 384), (50, 600), (16, 1)], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_kernel_linear_matches_float64(rows, n, k, bias):
    """Against F.linear in float64: as close as torch's own float32 F.linear (a column tail past a panel of 16,
    K over more than one of the kernel's K steps, strided and batched inputs)."""
    torch.manual_seed(rows + n + k)
    lin = nn.Linear(k, n, bias=bias)
    ours = KernelLinear(lin, V3, "vision")
    x = torch.randn(rows, k)
    strided = torch.randn(k, rows).t()  # not contiguous: each row a column of another tensor
    wide = torch.randn(rows, k + 5)[:, 2 : 2 + k]  # rows k + 5 apart
    batched = torch.randn(2, rows, k)
    with torch.no_grad():
        for inp in (x, strided, wide, batched):
            exact = F.linear(
                inp.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double()
            )
            theirs = (
                (F.linear(inp, lin.weight, lin.bias).double() - exact).abs().max().item() if rows else 0.0
            )
            got = ours(inp)
            assert got.shape == exact.shape and got.dtype == torch.float32
            err = (got.double() - exact).abs().max().item() if rows else 0.0
            assert err <= 2 * theirs + 1e-6, (err, theirs)
    assert torch.equal(ours.state_dict()["weight"], lin.weight.detach())


@needs_v3
@pytest.mark.parametrize("k", [2048, 4096])
def test_kernel_linear_sums_long_rows_as_closely_as_torch(k):
    """Long dot products stay as close to float64 as torch's float32 F.linear: the kernel sums in chains of 256
    products (one chain over all of K was 4.9x and 5.6x torch's error at these K on an AMX Xeon)."""
    torch.manual_seed(k)
    x, lin = torch.randn(64, k), nn.Linear(k, 64)
    with torch.no_grad():
        exact = F.linear(x.double(), lin.weight.double(), lin.bias.double())
        theirs = (F.linear(x, lin.weight, lin.bias).double() - exact).abs().max().item()
        err = (KernelLinear(lin, V3, "vision")(x).double() - exact).abs().max().item()
    assert err <= 2 * theirs, (err, theirs)


@needs_v3
def test_kernel_linear_is_the_same_on_every_pool_and_thread_count():
    torch.manual_seed(0)
    lin = nn.Linear(768, 1000)
    x = torch.randn(517, 768)
    with torch.no_grad():
        want = KernelLinear(lin, V3, "vision")(x)
        assert torch.equal(KernelLinear(lin, V3, "prefill")(x), want)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(KernelLinear(lin, V3, "vision")(x), want)
        finally:
            torch.set_num_threads(threads)


@needs_v3
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("n,k", [(776, 384), (50, 600), (16, 1)], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_silu_gated_matches_float64_and_the_unfused_kernels(rows, n, k, bias):
    """The gated MLP's gate, up and silu · up in one pass (a column tail past a panel of 16, K over two of the
    kernel's K steps, strided and batched inputs): equal to the two projections and silu_mul run apart, and on
    those projections within a few float32 steps of silu(g) · u in float64 (the projections' own accuracy is
    test_kernel_linear_matches_float64's)."""
    torch.manual_seed(rows + n + k + 1)
    gate, up = nn.Linear(k, n, bias=bias), nn.Linear(k, n, bias=bias)
    g, u = KernelLinear(gate, V3, "vision"), KernelLinear(up, V3, "vision")
    x = torch.randn(rows, k) * 2
    strided = torch.randn(k, rows).t()
    batched = torch.randn(2, rows, k)
    with torch.no_grad():
        for inp in (x, strided, batched):
            got = packing.silu_gated(g, u, inp)
            gk, uk = g(inp), u(inp)
            assert got.shape == gk.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, cpu_kernel.silu_mul(V3, gk, uk), atol=1e-6, rtol=1e-6)
            _assert_silu_product(got, gk, uk)


def _assert_silu_product(got: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    """``got`` within four float32 steps of the largest |silu(gate) · up|, that product taken in float64."""
    if not got.numel():
        return
    exact = F.silu(gate.double()) * up.double()
    err = (got.double() - exact).abs().max().item()
    assert err <= 4 * 2.0**-23 * exact.abs().max().item(), err


@needs_v3
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("n,k", [(176, 64), (2048, 768)], ids=str)
def test_silu_gated_halves_matches_the_decoders_torch_mlp(rows, n, k):
    """A decoder's merged gate_up projection: silu of the first half times the second, in one pass, as torch's
    chunk / silu / product computes it from the same projection (to float32's rounding)."""
    torch.manual_seed(rows + n)
    lin = nn.Linear(k, 2 * n, bias=False)
    ours = KernelLinear(lin, V3, "prefill")
    assert packing.halves_split(ours)
    x = torch.randn(rows, k)
    with torch.no_grad():
        got = packing.silu_gated_halves(ours, x)
        gate, up = ours(x).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    _assert_silu_product(got, gate, up)


def test_silu_gated_halves_needs_whole_panels():
    if not cpu_kernel.has_linear(V3):
        pytest.skip("no float32 linear build here")
    odd = KernelLinear(nn.Linear(8, 2 * 24, bias=False), V3, "prefill")  # halves of 24: a panel and a half
    assert not packing.halves_split(odd) and not packing.halves_split(nn.Linear(8, 64))
    with pytest.raises(ValueError, match="panels of 16"):
        packing.silu_gated_halves(odd, torch.randn(2, 8))


def test_silu_gated_refuses_mismatched_projections():
    if not cpu_kernel.has_linear(V3):
        pytest.skip("no float32 linear build here")
    g = KernelLinear(nn.Linear(8, 16), V3, "vision")
    with pytest.raises(ValueError, match="differ"):
        packing.silu_gated(g, KernelLinear(nn.Linear(8, 32), V3, "vision"), torch.randn(3, 8))
    with pytest.raises(ValueError, match="differ"):
        packing.silu_gated(g, KernelLinear(nn.Linear(8, 16), V3, "prefill"), torch.randn(3, 8))
    with pytest.raises(ValueError):
        packing.silu_gated(
            g, KernelLinear(nn.Linear(8, 16), V3, "vision"), torch.randn(3, 8, dtype=torch.float64)
        )


def test_kernel_linear_refuses_what_it_cannot_do():
    if not cpu_kernel.has_linear(V3):
        pytest.skip("no float32 linear build here")
    ours = KernelLinear(nn.Linear(8, 16), V3, "vision")
    with pytest.raises(ValueError):
        ours(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError):
        ours(torch.randn(3, 9))
    with pytest.raises(ValueError):
        cpu_kernel.pack_linear(V3, torch.randn(4, 4).to(torch.bfloat16))


@needs_v3
def test_engine_generates_the_same_ids_on_the_float32_kernel(tiny_ckpt, monkeypatch):
    """The decoder's and the tower's float32 linear layers on our kernel (forced, whatever this CPU's timing
    says): the same greedy ids as with torch's F.linear."""
    monkeypatch.setattr(packing, "kernel_linear_is_faster", lambda: True)
    monkeypatch.setattr(cpu_kernel, "load", lambda march="native": V3)

    def ids(switch: str) -> list[list[int]]:
        monkeypatch.setenv("VLMSERVE_KERNEL_LINEAR", switch)

        def check(runner) -> None:
            kernels = [
                m for m in (*runner.model.modules(), *runner.vision.modules()) if isinstance(m, KernelLinear)
            ]
            assert (len(kernels) > 0) == (switch == "1")
            assert {m.pool for m in runner.model.modules() if isinstance(m, KernelLinear)} <= {"prefill"}
            # the decoder's gated MLPs take the one-pass gate, up and silu · up (176 = 11 panels a half)
            mlps = [m for name, m in runner.model.named_modules() if name.endswith(".mlp")]
            assert mlps and all(packing.halves_split(m.gate_up_proj) == (switch == "1") for m in mlps)

        return _engine_ids(tiny_ckpt, "float32", check)

    assert ids("1") == ids("0")


def _linear_in_child(conn):
    try:
        lin = nn.Linear(384, 1152)
        x = torch.randn(300, 384)
        packed = cpu_kernel.pack_linear(V3, lin.weight.detach())
        torch.set_num_threads(2)  # the library is asked for two threads
        got = cpu_kernel.linear(V3, x, packed, 1152, None, "vision")
        # NOTE: torch's own OpenMP threads do not survive fork either; the reference runs on one thread.
        torch.set_num_threads(1)
        with torch.no_grad():
            conn.send(bool(torch.allclose(got, F.linear(x, lin.weight), atol=1e-4)))
    except Exception as exc:  # report, do not hang the parent
        conn.send(repr(exc))


@needs_v3
def test_kernel_works_in_a_forked_child():
    """The parent ran the library's calls on OpenMP threads; a forked child (whose OpenMP team is gone) asks
    for two threads and must get an answer, not hang."""
    import multiprocessing as mp

    torch.manual_seed(1)
    lin = nn.Linear(384, 1152)
    with torch.no_grad():
        KernelLinear(lin, V3, "vision")(torch.randn(600, 384))  # two threads in the parent
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_linear_in_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(30), "the forked child hung in the kernel"
        assert parent.recv() is True
    finally:
        proc.kill()
        proc.join()


def test_packing_frees_each_plain_weight_as_it_goes(monkeypatch):
    """When a layer is packed, the layers packed before it hold no plain weight any more: packing a model
    needs one layer's extra memory, not the model's (a 7B decoder's 14 GB held twice did not fit 24 GiB)."""
    import gc
    import weakref

    weights: list[weakref.ref] = []
    alive_at_each_swap: list[int] = []

    class Copy(nn.Module):  # stands for PackedLinear: a copy of the weight in another layout
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            gc.collect()
            alive_at_each_swap.append(sum(w() is not None for w in weights))
            self.packed = linear.weight.detach().clone()

    monkeypatch.setattr(packing, "packing_applies", lambda weight: True)
    monkeypatch.setattr(packing, "PackedLinear", Copy)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 4))
    weights += [weakref.ref(m.weight) for m in model.modules() if isinstance(m, nn.Linear)]
    assert pack_linears(model) == 3
    # the layer being packed and those not reached yet are alive; none packed before
    assert alive_at_each_swap == [3, 2, 1]
    assert sum(isinstance(m, Copy) for m in model.modules()) == 3
