"""Wire format of an embedding stored outside the process (Redis).

Raw tensor bytes behind a small self-describing header, so a reader can check what it got
without ever unpickling: anything read from a shared store is untrusted input.

    offset   size    field
    0        4       magic b"VLME"
    4        1       format version (2)
    5        1       n = length of the dtype name
    6        1       d = number of dimensions (<= 8)
    7        1       k = length of the key digest
    8        1       L = deepstack levels each row carries after the main embedding (0: none)
    9        n       dtype name, ASCII, e.g. "float32", "bfloat16"
    9+n      k       key digest, ASCII hex (EmbeddingKey.digest(), echoed to catch misfiled values)
    9+n+k    8*d     shape, little-endian uint64 per dimension
    ...              payload: C-contiguous little-endian element bytes, prod(shape) * itemsize long

An image's embedding is one entry: its rows are [main | level 1 | … | level L] along the last axis. A reader
states the levels it expects; an entry of another version (version 1 had no level count) or another level
count is refused (a miss, recomputed), never read under the wrong layout.
"""

from __future__ import annotations

import math
import struct
import sys

import torch

MAGIC = b"VLME"
VERSION = 2
MAX_NDIM = 8
MAX_LEVELS = 255
_FIXED = struct.Struct("<4sBBBBB")

# Only plain float dtypes are accepted: each one has a fixed itemsize and no object payload.
ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}

# NOTE: the payload is the host's raw memory; every supported host is little-endian, and the
# format says little-endian, so a big-endian host must not write or read it unconverted.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("cache.codec assumes a little-endian host")


class CorruptEntry(ValueError):
    """A stored value that is not a well-formed entry for the requested key."""


def encode(digest: str, tensor: torch.Tensor, levels: int = 0) -> bytes:
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"dtype {tensor.dtype} is not storable; allowed: {sorted(ALLOWED_DTYPES)}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {tensor.dim()}")
    if not 0 <= levels <= MAX_LEVELS or (levels and (tensor.dim() == 0 or tensor.shape[-1] % (1 + levels))):
        raise ValueError(f"{levels} levels do not split a tensor of shape {tuple(tensor.shape)}")
    name_b, digest_b = name.encode("ascii"), digest.encode("ascii")
    t = tensor.detach().to("cpu").contiguous()
    # A byte view reinterprets bf16 (which numpy lacks) without converting any value.
    payload = t.reshape(-1).view(torch.uint8).numpy()
    header = b"".join(
        (
            _FIXED.pack(MAGIC, VERSION, len(name_b), t.dim(), len(digest_b), levels),
            name_b,
            digest_b,
            struct.pack(f"<{t.dim()}Q", *t.shape),
        )
    )
    return b"".join((header, payload))


def decode(digest: str, data: bytes, levels: int = 0) -> torch.Tensor:
    """Parse `data` stored under `digest` as an entry of `levels` deepstack levels; raise CorruptEntry on
    anything unexpected."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CorruptEntry(f"{len(view)} bytes is shorter than the header")
    magic, version = bytes(view[:4]), view[4]
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptEntry(f"unsupported format version {version}")
    _, _, name_len, ndim, digest_len, stored_levels = _FIXED.unpack_from(view, 0)
    if stored_levels != levels:
        raise CorruptEntry(f"entry carries {stored_levels} deepstack levels, the reader wants {levels}")
    if ndim > MAX_NDIM:
        raise CorruptEntry(f"{ndim} dimensions exceeds {MAX_NDIM}")
    offset = _FIXED.size
    shape_at = offset + name_len + digest_len
    payload_at = shape_at + 8 * ndim
    if len(view) < payload_at:
        raise CorruptEntry("truncated header")
    name = bytes(view[offset : offset + name_len]).decode("ascii", errors="replace")
    echoed = bytes(view[offset + name_len : shape_at]).decode("ascii", errors="replace")
    if echoed != digest:
        raise CorruptEntry(f"value belongs to key {echoed!r}, not {digest!r}")
    dtype = ALLOWED_DTYPES.get(name)
    if dtype is None:
        raise CorruptEntry(f"dtype {name!r} not allowed")
    shape = struct.unpack_from(f"<{ndim}Q", view, shape_at)
    expected = math.prod(shape) * dtype.itemsize
    if len(view) - payload_at != expected:
        raise CorruptEntry(f"payload is {len(view) - payload_at} bytes, shape {shape} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: one copy into memory the tensor owns and may write (frombuffer keeps it alive).
    return torch.frombuffer(bytearray(view[payload_at:]), dtype=dtype).reshape(shape)
