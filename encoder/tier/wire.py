"""The encoder tier's wire format: frames of a JSON header and raw bytes, never pickle.

    offset  size  field
    0       4     magic b"VLEF"
    4       4     h = header length (little-endian uint32, at most MAX_HEADER)
    8       8     p = payload length (little-endian uint64, at most the reader's max_payload)
    16      h     header: a UTF-8 JSON object; "op" names the message
    16+h    p     payload: raw bytes (an image as received; an embedding in the cache.codec format)

On a Unix socket a frame may carry one file descriptor (SCM_RIGHTS) with its first bytes: a memfd holding a
``cache.codec`` entry, which is how an embedding reaches an engine on the same host without a copy through
the socket. Its header says ``"fd": true``; descriptors arrive in the order of their frames.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections import deque

from cache import EmbeddingKey
from preprocess.hashing import is_image_hash

MAGIC = b"VLEF"
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 1 << 16
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize * 8)


class ProtocolError(ValueError):
    """A peer sent something that is not a well-formed frame."""


def pack(header: dict, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"frame header of {len(head)} bytes exceeds {MAX_HEADER}")
    return [_PREFIX.pack(MAGIC, len(head), len(payload)) + head, payload]


def send(sock: socket.socket, header: dict, payload: bytes | memoryview = b"", fd: int | None = None) -> None:
    """One frame; the caller serialises senders on a socket."""
    first, body = pack(header, payload)
    if fd is None:
        sock.sendall(first)
    else:
        sent = socket.send_fds(sock, [first], [fd])
        if sent < len(first):
            sock.sendall(memoryview(first)[sent:])
    if len(body):
        sock.sendall(body)


class Reader:
    """Frames from a stream socket, with the descriptors that came along (Unix sockets)."""

    def __init__(self, sock: socket.socket, max_payload: int = 1 << 30) -> None:
        self.sock = sock
        self.max_payload = max_payload
        self._buf = bytearray()
        self._fds: deque[int] = deque()

    def _fill(self, need: int) -> None:
        while len(self._buf) < need:
            # NOTE: at most 1 MiB per call: recvmsg allocates what it is offered, however little arrives.
            want = min(max(65536, need - len(self._buf)), 1 << 20)
            data, anc, _flags, _addr = self.sock.recvmsg(want, _FD_SPACE)
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                    self._fds.extend(fds)
            if not data:
                raise EOFError("peer closed the connection")
            self._buf += data

    def read(self) -> tuple[dict, bytes, int | None]:
        """The next frame: (header, payload, descriptor or None). Raises EOFError when the peer is gone."""
        self._fill(_PREFIX.size)
        magic, head_len, body_len = _PREFIX.unpack_from(self._buf)
        if magic != MAGIC or head_len > MAX_HEADER or body_len > self.max_payload:
            raise ProtocolError(f"bad frame (magic {bytes(magic)!r}, header {head_len}, payload {body_len})")
        end = _PREFIX.size + head_len + body_len
        self._fill(end)
        try:
            header = json.loads(self._buf[_PREFIX.size : _PREFIX.size + head_len])
        except ValueError as exc:
            raise ProtocolError(f"frame header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ProtocolError("frame header is not a JSON object")
        payload = bytes(self._buf[_PREFIX.size + head_len : end])
        del self._buf[:end]
        fd = None
        if header.get("fd"):
            if not self._fds:
                raise ProtocolError("frame announced a descriptor that did not come")
            fd = self._fds.popleft()
        return header, payload, fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())


def key_to_json(key: EmbeddingKey) -> dict:
    return {
        "image_hash": key.image_hash,
        "grid": list(key.grid),
        "preprocess": key.preprocess_fingerprint,
        "model": key.model_fingerprint,
        "levels": key.levels,  # part of the key's identity (and of the entry's layout): Qwen3-VL's deepstack
        "hash": key.hash_algorithm,
        "salt": key.cache_salt,
    }


def key_from_json(obj: object, hash_algorithm: str) -> EmbeddingKey:
    """A key received from a peer, which must be hashed with ``hash_algorithm`` (the receiver's own)."""
    if not isinstance(obj, dict):
        raise ProtocolError("key is not an object")
    if obj.get("hash") != hash_algorithm or not is_image_hash(obj.get("image_hash"), hash_algorithm):
        raise ProtocolError(f"bad key: its image hash is not a {hash_algorithm} digest")
    try:
        grid = tuple(int(g) for g in obj["grid"])
        levels = int(obj.get("levels", 0))
        pre, model, salt = str(obj["preprocess"]), str(obj["model"]), str(obj.get("salt", ""))
        return EmbeddingKey(obj["image_hash"], grid, pre, model, levels, hash_algorithm, salt)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad key: {exc}") from None


def memfd_with(data: bytes) -> int:
    """A sealed-size anonymous memory file holding ``data`` (the receiver maps it, the kernel frees it)."""
    fd = os.memfd_create("vlmserve-embedding", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, size: int) -> bytes:
    """The ``size`` bytes of a received memfd; the descriptor is closed."""
    try:
        return os.pread(fd, size, 0) if size else b""
    finally:
        os.close(fd)
