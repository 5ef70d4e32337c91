"""An embedding entry carries its deepstack level count: another count, or the level-less version 1, is refused."""

from __future__ import annotations

import struct

import pytest
import torch

from cache import EmbeddingKey, codec
from cache.codec import CorruptEntry

DIGEST = "0123456789abcdef0123456789abcdef"


def version_1_entry(digest: str, tensor: torch.Tensor) -> bytes:
    """The bytes the previous format (no level count) wrote."""
    name, dig = b"float32", digest.encode()
    head = b"VLME" + bytes([1, len(name), tensor.dim(), len(dig)]) + name + dig
    return head + struct.pack(f"<{tensor.dim()}Q", *tensor.shape) + tensor.contiguous().numpy().tobytes()


def test_levels_round_trip_and_mismatch_is_refused() -> None:
    rows = torch.randn(6, 3 * 8)  # main + 2 levels of width 8
    data = codec.encode(DIGEST, rows, levels=2)
    assert torch.equal(codec.decode(DIGEST, data, levels=2), rows)
    for wrong in (0, 1, 3):
        with pytest.raises(CorruptEntry, match="levels"):
            codec.decode(DIGEST, data, levels=wrong)
    with pytest.raises(CorruptEntry, match="levels"):  # written without levels, read by a deepstack model
        codec.decode(DIGEST, codec.encode(DIGEST, rows), levels=2)


def test_version_1_entry_is_refused() -> None:
    rows = torch.randn(6, 24)
    for levels in (0, 2):
        with pytest.raises(CorruptEntry, match="version 1"):
            codec.decode(DIGEST, version_1_entry(DIGEST, rows), levels=levels)


def test_levels_that_do_not_split_the_rows_are_refused_on_write() -> None:
    with pytest.raises(ValueError):
        codec.encode(DIGEST, torch.zeros(4, 10), levels=2)


def test_level_count_is_part_of_the_key() -> None:
    key = EmbeddingKey("ab" * 16, (1, 8, 8), "pre", "model")
    assert key.levels == 0
    assert len({key.digest(), EmbeddingKey("ab" * 16, (1, 8, 8), "pre", "model", 2).digest()}) == 2
    assert EmbeddingKey("ab" * 16, (1, 8, 8), "pre", "model", 3) != EmbeddingKey(
        "ab" * 16, (1, 8, 8), "pre", "model", 2
    )
