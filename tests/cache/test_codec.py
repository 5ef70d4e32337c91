from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
import torch

from cache import codec
from cache.codec import CorruptEntry

DIGEST = "0123456789abcdef0123456789abcdef"
SameBits = Callable[[torch.Tensor, torch.Tensor], bool]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(), (0,), (0, 7), (3,), (16, 24), (2, 3, 5)])
def test_round_trip_is_bit_exact(
    dtype: torch.dtype, shape: tuple[int, ...], random_bits: Callable[..., torch.Tensor], same_bits: SameBits
) -> None:
    t = random_bits(shape, dtype)  # NaN payloads and infinities must survive too
    assert same_bits(codec.decode(DIGEST, codec.encode(DIGEST, t)), t)


def test_non_contiguous_input_round_trips(same_bits: SameBits) -> None:
    t = torch.randn(6, 10).to(torch.bfloat16).t()[::2]
    out = codec.decode(DIGEST, codec.encode(DIGEST, t))
    assert out.is_contiguous() and same_bits(out, t.contiguous())


def test_decoded_tensor_owns_writable_memory() -> None:
    out = codec.decode(DIGEST, codec.encode(DIGEST, torch.zeros(4)))
    out += 1  # would fault or warn on a read-only buffer
    assert out.tolist() == [1.0] * 4


def test_header_layout() -> None:
    data = codec.encode(DIGEST, torch.zeros(2, 3, dtype=torch.bfloat16))
    name, digest = b"bfloat16", DIGEST.encode()
    header = b"VLME" + bytes([2, len(name), 2, len(digest), 0]) + name + digest + struct.pack("<2Q", 2, 3)
    assert data == header + bytes(12)


def test_unsupported_dtype_is_refused_on_write() -> None:
    with pytest.raises(TypeError):
        codec.encode(DIGEST, torch.arange(4))


def _valid() -> bytes:
    return codec.encode(DIGEST, torch.ones(2, 3))


def _with_dtype_name(name: bytes) -> bytes:
    digest = DIGEST.encode()
    return (
        b"VLME"
        + bytes([2, len(name), 2, len(digest), 0])
        + name
        + digest
        + struct.pack("<2Q", 2, 3)
        + bytes(6 * 8)
    )


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"VLM", id="shorter-than-header"),
        pytest.param(b"XXXX" + _valid()[4:], id="bad-magic"),
        pytest.param(_valid()[:4] + b"\x03" + _valid()[5:], id="future-version"),
        pytest.param(_valid()[:4] + b"\x01" + _valid()[5:], id="version-1"),
        pytest.param(_valid()[:20], id="truncated-header"),
        pytest.param(_valid()[:-1], id="payload-short"),
        pytest.param(_valid() + b"\0", id="payload-long"),
        pytest.param(codec.encode("f" * 32, torch.ones(2, 3)), id="wrong-key-echo"),
        pytest.param(_with_dtype_name(b"int64"), id="dtype-not-allowed"),
        pytest.param(_with_dtype_name(b"object"), id="dtype-object"),
        pytest.param(_valid()[:6] + b"\x09" + _valid()[7:], id="too-many-dims"),
    ],
)
def test_malformed_values_are_rejected(data: bytes) -> None:
    with pytest.raises(CorruptEntry):
        codec.decode(DIGEST, data)
