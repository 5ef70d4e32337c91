"""The towers' LayerNorm on the compiled kernel (encoder.models.qwen2_vl.LayerNorm): torch's formula in bfloat16,
and a block's residual add and second norm in one call (add_norm); float32 keeps torch's ops."""

from __future__ import annotations

import pytest
import torch

from encoder.models.qwen2_vl import Block, LayerNorm, Mlp, add_norm
from runtime import cpu_kernel

LIB = cpu_kernel.load()
needs_lib = pytest.mark.skipif(LIB is None, reason="no compiler here: the towers keep torch's LayerNorm")


def norm_of(cols: int, dtype: torch.dtype, seed: int) -> LayerNorm:
    gen = torch.Generator().manual_seed(seed)
    norm = LayerNorm(cols, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(cols, generator=gen) + 0.5)
        norm.bias.copy_(torch.rand(cols, generator=gen) - 0.5)
    return norm.to(dtype)


@needs_lib
@pytest.mark.parametrize(("rows", "cols"), [(1, 1280), (37, 1152), (300, 100), (5, 7)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_kernel_is_torchs_layer_norm(rows, cols, threads):
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * 3 + 1).to(torch.bfloat16)
    y = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    norm = norm_of(cols, torch.bfloat16, cols)
    with torch.no_grad():
        want = torch.nn.functional.layer_norm(x, (cols,), norm.weight, norm.bias, norm.eps)
        got = cpu_kernel.layer_norm(LIB, x, norm.weight, norm.bias, norm.eps, threads=threads)
        total, got2 = cpu_kernel.layer_norm(
            LIB, x, norm.weight, norm.bias, norm.eps, residual=y, threads=threads
        )
        want2 = torch.nn.functional.layer_norm(x + y, (cols,), norm.weight, norm.bias, norm.eps)
    assert torch.equal(total, x + y)  # the add rounded as torch's
    for g, w in ((got, want), (got2, want2)):
        # the mean and variance are summed in another order: a last-bit difference now and then
        assert (g != w).float().mean() < 2e-3
        torch.testing.assert_close(g.float(), w.float(), atol=1e-2, rtol=8e-3)


@needs_lib
def test_kernel_refuses_mismatched_inputs():
    x = torch.randn(4, 16).to(torch.bfloat16)
    w, b = torch.ones(16).to(torch.bfloat16), torch.zeros(16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="must be"):
        cpu_kernel.layer_norm(LIB, x, w[:8], b, 1e-6)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernel.layer_norm(LIB, x, w.float(), b, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_kernel.layer_norm(LIB, x, w, b, 1e-6, residual=x[:2])


@needs_lib
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_takes_the_kernel_in_bf16_only(dtype, monkeypatch):
    """A tower block with the kernels: bf16 runs norm2 and the residual add as one kernel call and stays within
    rounding of torch's block; float32 never calls the kernel and is torch's block to the bit."""
    torch.manual_seed(0)
    block = Block(64, 4, Mlp(64, 128, "quick_gelu")).to(dtype).eval()
    plain = Block(64, 4, Mlp(64, 128, "quick_gelu")).to(dtype).eval()
    plain.load_state_dict(block.state_dict())
    for module in block.modules():
        if isinstance(module, LayerNorm):  # the norms only: the MLP's activation kernel is tested elsewhere
            module.use_kernels(LIB)
    calls = []
    real = cpu_kernel.layer_norm
    monkeypatch.setattr(
        cpu_kernel, "layer_norm", lambda *a, **k: calls.append("residual" in k) or real(*a, **k)
    )
    x = torch.randn(50, 64).to(dtype)

    def attend(qkv, cos, sin, segments, scale):  # plain attention over one segment: the block's own part
        q, k, v = qkv.unbind(1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )
        return out.transpose(0, 1).reshape(qkv.shape[0], -1)

    batch = type("Batch", (), {"cos": None, "sin": None, "segments": None})()
    with torch.no_grad():
        got, want = block(x, batch, attend), plain(x, batch, attend)
    if dtype == torch.float32:
        assert calls == [] and torch.equal(got, want)
    else:
        assert calls == [False, True]  # norm1 alone, then the add and norm2 in one
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=2e-2)


def test_add_norm_without_a_fused_norm_is_add_then_norm():
    norm = torch.nn.LayerNorm(8)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    total, out = add_norm(norm, x, y)
    assert torch.equal(total, x + y) and torch.equal(out, norm(x + y))


@needs_lib
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_tanh_kernel_is_torchs_approximation(dtype):
    """Qwen3-VL's tower activation on the kernel: torch's gelu(approximate="tanh") but for one-step bf16
    differences on under 1 % of the outputs over 1e-3; the tiny outputs (where torch's tanh form cancels) no
    further from float64 than torch's own."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 4304 + 5, generator=gen) * 3).to(dtype)  # a row tail past the vector lanes
    want = torch.nn.functional.gelu(x, approximate="tanh")
    got = cpu_kernel.gelu_tanh_(LIB, x.clone())
    exact = torch.nn.functional.gelu(x.double(), approximate="tanh")
    big = want.abs() > 1e-3
    if dtype == torch.bfloat16:
        assert (got != want)[big].float().mean() < 1e-2
    torch.testing.assert_close(got[big].float(), want[big].float(), atol=0, rtol=8e-3)
    assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max() + 1e-6


@needs_lib
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qwen3_mlp_takes_the_gelu_kernel_in_bf16_only(dtype, monkeypatch):
    calls = []
    real = cpu_kernel.gelu_tanh_
    monkeypatch.setattr(cpu_kernel, "gelu_tanh_", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    mlp = Mlp(64, 200, "gelu_pytorch_tanh").to(dtype).eval()
    plain = Mlp(64, 200, "gelu_pytorch_tanh").to(dtype).eval()
    plain.load_state_dict(mlp.state_dict())
    mlp.use_kernels(LIB)
    x = torch.randn(40, 64).to(dtype)
    with torch.no_grad():
        got, want = mlp(x), plain(x)
    if dtype == torch.float32:
        assert calls == [] and torch.equal(got, want)
    else:
        assert calls == [1]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
