"""The plain-torch varlen attention (the reference path, and the one a GPU runs): segments of one length attend
in one batched call, and every segment still attends only within itself."""

from __future__ import annotations

import pytest
import torch

from encoder.attention import Segments, TorchAttention


def test_segments_group_by_length():
    seg = Segments.of_lengths([64, 64, 32, 64, 0, 64, 16, 16])
    groups = {length: (count, where) for length, count, where in seg.by_length(torch.device("cpu"))}
    assert set(groups) == {64, 32, 16}  # the empty segment attends nowhere
    count, rows = groups[64]  # starts 0, 64, 160, 224: not back to back, so an index of their rows
    assert count == 4 and rows.tolist() == [*range(0, 128), *range(160, 288)]
    assert groups[32] == (1, 128) and groups[16] == (2, 288)  # back to back: a plain slice from row 128 / 288
    assert seg.by_length(torch.device("cpu")) is seg.by_length(torch.device("cpu"))  # built once a pass


def reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int], scale: float):
    """Rotary and softmax(q·kᵀ·scale)·v segment by segment, in float64, written out."""
    q, k, v = qkv.double().unbind(1)  # [N, H, D]
    c = torch.cat([cos, cos], -1).double()[:, None]
    s = torch.cat([sin, sin], -1).double()[:, None]

    def rot(x):
        half = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s

    q, k = rot(q), rot(k)
    out, start = torch.zeros_like(q), 0
    for n in lengths:
        rows = slice(start, start + n)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * scale
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows])
        start += n
    return out.flatten(1)


@pytest.mark.parametrize(
    "lengths",
    [[64, 64, 32, 64, 0, 64, 16, 16], [1, 1, 1], [300], [7, 64, 7, 64, 64, 5, 7]],
    ids=str,
)
def test_grouped_segments_attend_only_within_themselves(lengths):
    heads, d = 3, 32
    gen = torch.Generator().manual_seed(sum(lengths))
    n = sum(lengths)
    qkv = torch.randn(n, 3, heads, d, generator=gen)
    qkv[:, 0] *= 3  # a sharp softmax: a row that saw another segment's keys would move
    angle = torch.rand(n, d // 2, generator=gen) * 20
    got = TorchAttention()(qkv, angle.cos(), angle.sin(), Segments.of_lengths(lengths), d**-0.5)
    want = reference(qkv, angle.cos(), angle.sin(), lengths, d**-0.5)
    assert got.shape == (n, heads * d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
