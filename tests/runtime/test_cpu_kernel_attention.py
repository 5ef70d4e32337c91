"""The compiled varlen attention kernel against the plain-torch path (rotary + SDPA per segment)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from encoder.attention import KernelAttention, Segments, TorchAttention, choose_attention, cpu_kernel

LIB = cpu_kernel.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the kernel could not be built")

# Segment lengths around the kernel's 64-row blocks, its 16-row (bf16) and 4-row (float32) tiles, 16-key
# score tiles and 32-key float32 steps (AVX2), one-patch segments, empty ones.
LENGTHS = [[1], [63, 64, 65], [200, 1, 130, 4], [0, 7, 0, 300], [15, 16, 17, 33]]
SHAPES = [(2, 16), (3, 64), (2, 80), (1, 128)]  # (heads, head_dim): tiny, small, Qwen2-VL's, wide
# head dims whose tail after the 64-wide register blocks is 32 and 48 (the products' 2- and 3-vector cases)
TAILS = [(1, 96), (1, 112)]


def case(lengths: list[int], heads: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    qkv = torch.randn(n, 3, heads, d, generator=gen)
    qkv[:, 0] *= 3  # sharp softmax: the running max moves from block to block
    angle = torch.rand(n, d // 2, generator=gen) * 20
    return qkv.to(dtype), angle.cos(), angle.sin(), Segments.of_lengths(lengths)


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def build(request):
    """The kernel as this CPU builds it (``-march=native``), and its AVX2 + FMA build without AVX-512
    (``-march=x86-64-v3``: 8 lanes, two rows per register pass) wherever this CPU runs it: the products and
    broadcasts are written per instruction set, and CI lands on whatever CPU the day brings."""
    if request.param == "native":
        return LIB
    import platform

    from runtime.native import _cpu_flags

    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= set(_cpu_flags().split()):
        pytest.skip("not an x86-64 CPU with AVX2 and FMA")
    lib = cpu_kernel.load(request.param)
    assert lib is not None and cpu_kernel.isa(lib) == "fp32-fma"
    return lib


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
# (2, 160): segments of up to 64 rows wider than the float32 AVX2 path packs in its own units (over 128)
@pytest.mark.parametrize("heads,d", SHAPES + TAILS + [(2, 160)], ids=str)
def test_float32_matches_torch(build, lengths, heads, d):
    qkv, cos, sin, seg = case(lengths, heads, d, torch.float32, seed=sum(lengths) + d)
    want = TorchAttention()(qkv, cos, sin, seg, d**-0.5)
    got = KernelAttention(build)(qkv, cos, sin, seg, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == (sum(lengths), heads * d)
    torch.testing.assert_close(got, want, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
# (2, 160): segments of up to 64 rows wider than the bf16 paths pack in their own units (head dim over 128)
@pytest.mark.parametrize("heads,d", SHAPES + TAILS + [(2, 160)], ids=str)
def test_bfloat16_is_as_close_to_float32_as_torch_bf16(build, lengths, heads, d):
    """bf16 in, bf16 out: the kernel's error against float32 attention on the same (bf16) inputs stays
    within what torch's own bf16 path makes (rounding of q/k after the rotary, of P and of the output)."""
    qkv, cos, sin, seg = case(lengths, heads, d, torch.bfloat16, seed=sum(lengths) * 7 + d)
    exact = TorchAttention()(qkv.float(), cos, sin, seg, d**-0.5)
    torch_bf16 = TorchAttention()(qkv, cos, sin, seg, d**-0.5)
    got = KernelAttention(build)(qkv, cos, sin, seg, d**-0.5)
    assert got.dtype == torch.bfloat16
    ours = (got.float() - exact).abs().max().item()
    theirs = (torch_bf16.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)
    torch.testing.assert_close(got.float(), exact, atol=3e-2, rtol=3e-2)


AMX = LIB is not None and cpu_kernel.amx_ready(LIB)
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU (or kernel) gives no AMX-BF16 tiles")


@needs_amx
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
# (2, 160): segments of up to 64 rows wider than attend_short_amx packs itself (padded head dim over 128)
@pytest.mark.parametrize("heads,d", SHAPES + TAILS + [(2, 160)], ids=str)
def test_amx_is_as_close_to_float32_as_torch_bf16(lengths, heads, d):
    """The products on AMX tiles (q and k zero-padded to 32 dims: head dims 16, 80, 112 pad, 64 and 128 do not)
    against float32 attention, and against the same kernel's vdpbf16ps products: P and the inputs are rounded
    the same way, so only the order of the float32 sums differs."""
    qkv, cos, sin, seg = case(lengths, heads, d, torch.bfloat16, seed=sum(lengths) * 11 + d)
    exact = TorchAttention()(qkv.float(), cos, sin, seg, d**-0.5)
    torch_bf16 = TorchAttention()(qkv, cos, sin, seg, d**-0.5)
    got = KernelAttention(LIB, amx=True)(qkv, cos, sin, seg, d**-0.5)
    dots = KernelAttention(LIB)(qkv, cos, sin, seg, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (sum(lengths), heads * d)
    ours = (got.float() - exact).abs().max().item()
    theirs = (torch_bf16.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)
    # one bf16 rounding step of the output apart at most
    torch.testing.assert_close(got.float(), dots.float(), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
def test_bfloat16_weights_sum_to_one(amx):
    """Every value 1: softmax weights that sum to 1 give 1 in every output, as torch's bf16 attention does. P is
    rounded to bfloat16 by truncation, which alone would take ~0.3 % off the weights (a bfloat16 step below 1
    in most rows); the kernel centres it, and the mean output must stay within 5e-4 of 1."""
    if not amx and cpu_kernel.isa(LIB) != "avx512-bf16":
        pytest.skip("the bf16 dot products are what round P; this build computes P in float32")
    qkv, cos, sin, seg = case([1000, 64, 300, 3], 4, 64, torch.float32, seed=5)
    qkv[:, 2] = 1.0
    qkv = qkv.to(torch.bfloat16)
    torch_bf16 = TorchAttention()(qkv, cos, sin, seg, 64**-0.5).float()
    got = KernelAttention(LIB, amx=amx)(qkv, cos, sin, seg, 64**-0.5).float()
    assert (torch_bf16 - 1).abs().mean() <= 5e-4  # the oracle: sums to one, then rounded
    assert (got - 1).mean().abs() <= 5e-4, (got.mean(), (got < 1).float().mean())
    # causal prefill: the same, through vlm_causal_attention
    if cpu_kernel.causal_supported(LIB, qkv[:, 0]):
        q, k = qkv[:1000, 0], qkv[:1000, 1]
        out = cpu_kernel.causal_attention(LIB, q, k, torch.ones_like(k), 64**-0.5, amx=amx).float()
        assert (out - 1).mean().abs() <= 5e-4, (out.mean(), (out < 1).float().mean())


@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("gap", [30.0, 120.0])
def test_a_key_past_the_first_block_that_outweighs_the_rest(amx, gap):
    """After a row's first 64-key block the kernel takes blocks against the running max as it stands, with no
    pass for the block's own max, and takes a block again the exact way where a row's sum passes its bound. Here
    one key past the first block scores `gap` (natural units) above every other: at 30 the lazy pass overshoots
    its bound (2^43 against 2^24), at 120 its probabilities would overflow float32 had the block not been
    retaken. The output must still match float32 attention (and torch's bf16) on the same inputs."""
    if not amx and cpu_kernel.isa(LIB) != "avx512-bf16":
        pytest.skip("the lazy pass is the bf16 paths' (vdpbf16ps, AMX); this build computes P in float32")
    gen = torch.Generator().manual_seed(int(gap))
    lengths, heads, d = [300, 130], 2, 64
    n = sum(lengths)
    qkv = torch.randn(n, 3, heads, d, generator=gen)
    u = torch.nn.functional.normalize(torch.randn(heads, d, generator=gen), dim=-1)
    qkv[:, 0] = qkv[:, 0] * 0.3 + u * 4.0  # every query leans the same way per head
    for start, length in zip((0, 300), lengths):
        strong = start + length - 20  # in the segment's last block
        qkv[strong, 1] = u * (gap + 4.0) * d**0.5 / 4.0  # q · k · d^-0.5 ≈ gap + 4 there, ~0 ± 2 elsewhere
    qkv = qkv.to(torch.bfloat16)
    cos, sin = torch.ones(n, d // 2), torch.zeros(n, d // 2)  # no rotation: the alignment is the test's
    seg = Segments.of_lengths(lengths)
    exact = TorchAttention()(qkv.float(), cos, sin, seg, d**-0.5)
    torch_bf16 = TorchAttention()(qkv, cos, sin, seg, d**-0.5)
    got = KernelAttention(LIB, amx=amx)(qkv, cos, sin, seg, d**-0.5)
    assert torch.isfinite(got.float()).all()
    ours = (got.float() - exact).abs().max().item()
    theirs = (torch_bf16.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)
    # the strong key's value is the answer, nearly alone
    strong_v = qkv[torch.tensor([280, 410]), 2].float().reshape(2, heads * d)
    assert (exact[torch.tensor([0, 299])] - strong_v[0]).abs().max() < 1e-2
    # causal prefill (every block taken the exact way there): rows after the strong key see it, past their first block
    if cpu_kernel.causal_supported(LIB, qkv[:, 0]):
        q, k, v = (qkv[:300, i] for i in range(3))
        want = causal_reference(q, k, v, d**-0.5)
        mask = torch.ones(300, 300, dtype=torch.bool).tril()
        torch_causal = F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask, scale=d**-0.5
        ).transpose(0, 1)
        out = cpu_kernel.causal_attention(LIB, q, k, v, d**-0.5, amx=amx).float()
        assert torch.isfinite(out).all()
        ours, theirs = (out - want).abs().max(), (torch_causal.float() - want).abs().max()
        assert ours <= theirs + 1e-3, (ours, theirs)
        assert (out[290] - v[280].float()).abs().max() < 2e-2


@needs_amx
def test_amx_threads_do_not_change_the_result_and_float32_is_refused():
    qkv, cos, sin, seg = case([300, 5, 130, 64, 1], 3, 80, torch.bfloat16, seed=6)
    outs = [
        cpu_kernel.varlen_attention(LIB, qkv, cos, sin, seg.cu_seqlens, 0.1, num_threads=t, amx=True)
        for t in (1, 2, 3)
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(RuntimeError, match="code -6"):
        cpu_kernel.varlen_attention(LIB, qkv.float(), cos, sin, seg.cu_seqlens, 0.1, amx=True)


def test_auto_times_every_variant_and_keeps_one(monkeypatch):
    """``auto`` in bfloat16 times torch, the kernel and (with AMX) its tile variant, and keeps what the timing
    found fastest: a slowed variant is never picked."""
    import encoder.attention as attention

    names = ["torch", "cpu-kernel"] + (["cpu-kernel-amx"] if AMX else [])
    # each round times again instead of reading the last round's result
    monkeypatch.setenv("VLMSERVE_REMEASURE_PROBES", "1")
    for fast in names:
        monkeypatch.setattr(attention, "_CHOICE", {})
        timed = []

        def best_times(calls, fast=fast, timed=timed):
            timed.append(sorted(calls))
            return {name: (0.001 if name == fast else 1.0) for name in calls}

        monkeypatch.setattr(attention, "best_times", best_times)
        picked = choose_attention("auto", torch.device("cpu"), torch.bfloat16, 2, 64)
        assert picked.name == fast and timed == [sorted(names)], (fast, timed)


def test_threads_do_not_change_the_result():
    qkv, cos, sin, seg = case([300, 5, 130, 64, 1], 3, 64, torch.float32, seed=5)
    outs = [
        cpu_kernel.varlen_attention(LIB, qkv, cos, sin, seg.cu_seqlens, 0.125, num_threads=t)
        for t in (1, 2, 3)
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_refuses_what_it_cannot_do():
    qkv, cos, sin, seg = case([10, 20], 2, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        cpu_kernel.varlen_attention(LIB, qkv, cos, sin, torch.tensor([0, 10, 25], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernel.varlen_attention(LIB, qkv[..., :40], cos[:, :20], sin[:, :20], seg.cu_seqlens, 0.1)
    assert not cpu_kernel.supports(torch.float16, 64) and not cpu_kernel.supports(torch.float32, 72)
    # Where the kernel does not apply, auto falls back to torch and asking for the kernel is an error.
    assert choose_attention("auto", torch.device("cpu"), torch.float32, 2, 72).name == "torch"
    with pytest.raises(ValueError, match="does not apply"):
        choose_attention("cpu-kernel", torch.device("cpu"), torch.float32, 2, 72)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_quick_gelu_matches_torch(build, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 200, generator=gen) * 6).to(dtype)  # 200: not a multiple of the vector width
    bias = torch.randn(200, generator=gen).to(dtype)
    y = (x + bias).float()
    want = (y * torch.sigmoid(1.702 * y)).to(dtype)
    got = cpu_kernel.bias_quick_gelu_(build, x.clone(), bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # rounded once from float32: at most one bf16 step from the float32 value rounded
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)
    same = cpu_kernel.bias_quick_gelu_(build, x.clone(), None)
    torch.testing.assert_close(
        same.float(), (x.float() * torch.sigmoid(1.702 * x.float())), atol=1e-2, rtol=8e-3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [384, 1280, 100])  # 100: a tail past the vectors
def test_rms_norm_matches_the_towers_torch_norm(build, dtype, cols):
    """Against the tower's own torch RMSNorm (transformers' formula): float32 to its rounding, bf16 equal but for
    rare one-step differences (the sum of squares is added in another order)."""
    from encoder.models.qwen2_5_vl import RMSNorm

    gen = torch.Generator().manual_seed(cols)
    norm = RMSNorm(cols).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(cols, generator=gen) * 2)
    x = (torch.randn(300, cols, generator=gen) * 5).to(dtype)
    want = norm(x)
    got = cpu_kernel.rms_norm(build, x, norm.weight.detach(), norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    else:
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(build, dtype):
    gen = torch.Generator().manual_seed(5)
    gate = (torch.randn(70, 1000, generator=gen) * 4).to(dtype)  # 70 000: a tail past the 4096-element units
    up = torch.randn(70, 1000, generator=gen).to(dtype)
    want = F.silu(gate) * up
    got = cpu_kernel.silu_mul(build, gate, up)
    assert got.dtype == dtype and got.shape == gate.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2e-6)
    else:  # silu rounded then the product, as torch: rare one-step differences where silu's exp differs in its last bit
        assert (got != want).float().mean() < 3e-3
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=1.6e-2)
    with pytest.raises(ValueError, match="differ"):
        cpu_kernel.silu_mul(build, gate, up[:, :10])


# --------------------------------------------------------------- the decoder's causal prefill (bf16 only)

CAUSAL = cpu_kernel.causal_supported(LIB, torch.empty(1, 1, 64, dtype=torch.bfloat16))
needs_causal = pytest.mark.skipif(
    not CAUSAL, reason="the kernel has no AVX512-BF16 build here (test_causal_refuses_without_bf16_dots)"
)


def causal_reference(q, k, v, scale):
    """Float32 SDPA on the same bf16 inputs: query row i sees keys up to len(k) - len(q) + i."""
    lq, lk = q.shape[0], k.shape[0]
    visible = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
    qh, kh, vh = (t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


# (queries, keys, heads, kv heads, head dim): whole prompts, chunks after a cached prefix, around the 16-row
# tiles and 64-key blocks; grouped-query heads 1, 2, 6 to a kv head
CAUSAL_CASES = [
    (1, 1, 2, 1, 64),
    (5, 5, 4, 2, 16),
    (64, 64, 2, 2, 64),
    (65, 65, 12, 2, 64),
    (300, 300, 6, 1, 128),
    (17, 100, 12, 2, 64),
    (65, 200, 4, 1, 128),
    (130, 1000, 6, 3, 80),
]


@needs_causal
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)], ids=["vdpbf16ps", "amx"])
@pytest.mark.parametrize("lq,lk,heads,kv_heads,d", CAUSAL_CASES, ids=str)
def test_causal_is_as_close_to_float32_as_torch_bf16(lq, lk, heads, kv_heads, d, amx):
    gen = torch.Generator().manual_seed(lq * 7 + lk)
    # q as the decoder hands it: a view of a fused projection, rows strided
    fused = (torch.randn(lq, heads + 2, d, generator=gen) * 3).to(torch.bfloat16)
    q = fused[:, :heads]
    k = torch.randn(lk, kv_heads, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(lk, kv_heads, d, generator=gen).to(torch.bfloat16)
    scale = d**-0.5
    exact = causal_reference(q, k, v, scale)
    visible = torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
    torch_bf16 = (
        F.scaled_dot_product_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        .squeeze(0)
        .transpose(0, 1)
    )
    got = cpu_kernel.causal_attention(LIB, q, k, v, scale, amx=amx)
    assert got.dtype == torch.bfloat16 and got.shape == (lq, heads, d)
    ours = (got.float() - exact).abs()
    theirs = (torch_bf16.float() - exact).abs()
    assert ours.max() <= theirs.max() + 1e-3, (ours.max(), theirs.max())
    assert ours.mean() <= 1.1 * theirs.mean(), (ours.mean(), theirs.mean())


@needs_causal
def test_causal_threads_do_not_change_the_result():
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(n, h, 64, generator=gen).to(torch.bfloat16) for n, h in ((200, 12), (700, 2), (700, 2))
    )
    for amx in [False] + ([True] if AMX else []):
        outs = [cpu_kernel.causal_attention(LIB, q, k, v, 0.125, num_threads=t, amx=amx) for t in (1, 2, 3)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_causal_refuses_without_bf16_dots():
    """Where the library has no AVX512-BF16 build (or the input is not bf16) the backend keeps torch's prefill."""
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    assert not cpu_kernel.causal_supported(LIB, q.float())
    v3 = cpu_kernel.load("x86-64-v3")
    if v3 is not None:
        assert not cpu_kernel.causal_supported(v3, q)
        assert v3.vlm_causal_attention(*[None] * 4, 4, 4, 2, 2, 64, 128, 128, 128, 128, 0.1, 1, 0) == -6
    if CAUSAL:
        with pytest.raises(ValueError, match="queries"):
            cpu_kernel.causal_attention(LIB, q, q[:2], q[:2], 0.1)  # more queries than keys


def test_vlmserve_march_builds_the_default_library_for_another_cpu(monkeypatch):
    """``VLMSERVE_MARCH`` (benchmarks/as_avx2.sh) replaces ``-march=native`` in the default build, so an AVX2-only
    machine's code paths can be measured on a newer CPU; a caller's explicit target stays its own."""
    import platform
    import shutil

    from runtime.native import _build

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 targets")
    source, cc = cpu_kernel._SOURCE, shutil.which("cc")
    native, v3 = _build(cc, source, "native", ("-fopenmp",)), _build(cc, source, "x86-64-v3", ("-fopenmp",))
    assert native != v3
    monkeypatch.setenv("VLMSERVE_MARCH", "x86-64-v3")
    assert _build(cc, source, "native", ("-fopenmp",)) == v3
    monkeypatch.setenv("VLMSERVE_MARCH", "znver3")
    assert _build(cc, source, "x86-64-v3", ("-fopenmp",)) == v3
    monkeypatch.setenv("VLMSERVE_MARCH", " ")
    assert _build(cc, source, "native", ("-fopenmp",)) == native
