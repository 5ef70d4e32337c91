"""Who may use the encoder pool: a shared secret, proven in the hello and never sent, for TCP; a directory
only this user may enter for the Unix socket (``private_dir``).

The secret is read from a file on both sides:

    engine → pool   hello      {"nonce": e}
    pool → engine   challenge  {"nonce": p, "proof": HMAC(secret, "pool" | e | p)}
    engine → pool   auth       {"proof": HMAC(secret, "engine" | e | p)}
    pool → engine   hello      (or an "auth" error, and the connection closes)

Each side answers the other's fresh nonce, so a recorded exchange proves nothing on a new connection, and
neither proof can stand in for the other (the role is part of what is signed). The engine checks the pool's
proof too: an engine holding a secret talks only to a pool that holds it. The secret authenticates; it
does not encrypt: images and embeddings cross the network as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
import tempfile
from pathlib import Path

_CONTEXT = b"vlmserve-encoder-tier-auth-v1"
MIN_TOKEN_BYTES = 16


class TokenFileError(ValueError):
    """A token file that cannot serve as the shared secret (missing, too short, readable by every user)."""


def read_token(path: str | os.PathLike) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped).

    NOTE: a file every local user may read or write is refused rather than warned about: its secret admits
    anyone on the machine, and a warning in a log is read after the fact. chmod 600 (640 to share it with
    a group) is the fix, once, at start-up."""
    try:
        st = os.stat(path)
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TokenFileError(f"cannot read the auth token file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TokenFileError(f"the auth token file {path} is not a regular file")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise TokenFileError(
            f"the auth token file {path} is open to every user (mode {stat.S_IMODE(st.st_mode):o}); "
            f"chmod 600 {path} (640 to share it with a group)"
        )
    token = data.strip()
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenFileError(
            f"the auth token in {path} is {len(token)} bytes, fewer than {MIN_TOKEN_BYTES}; "
            "make one with: head -c 32 /dev/urandom | base64 > FILE"
        )
    return token


def new_nonce() -> str:
    return secrets.token_hex(32)


def proof(token: bytes, role: str, engine_nonce: str, pool_nonce: str) -> str:
    message = b"\0".join((_CONTEXT, role.encode(), engine_nonce.encode(), pool_nonce.encode()))
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def verify(token: bytes, role: str, engine_nonce: str, pool_nonce: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(proof(token, role, engine_nonce, pool_nonce), given)


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) binds this machine's loopback only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # every interface
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_exposure(host: str, token: bytes | None) -> None:
    """Refuse to listen beyond loopback without a secret: anyone who reaches the port could use the pool."""
    if token is None and not is_loopback(host):
        raise TokenFileError(
            f"--host {host or '(all interfaces)'} is reachable from other machines: give --auth-token-file "
            "(a secret the engines prove they hold, see README) or bind 127.0.0.1"
        )


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory only this user may enter: created with mode 0700, or, when it exists, refused
    unless it is a real directory (not a link) of this user's with no access for anyone else. Another user
    who made it first could otherwise take the socket's name, or connect to it."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory (a link?); give --socket elsewhere")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not this user; give --socket elsewhere")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it or give --socket"
        )
    return path


def default_socket_path(port: int) -> str:
    """``vlmserve encoder``'s Unix socket when none is given: in ``$XDG_RUNTIME_DIR/vlmserve`` (the user's
    own runtime directory) or else ``<tmp>/vlmserve-<uid>``, either one made private (``private_dir``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        where = Path(runtime) / "vlmserve"
    else:
        where = Path(tempfile.gettempdir()) / f"vlmserve-{os.geteuid()}"
    return str(private_dir(where) / f"encoder-{port or os.getpid()}.sock")
