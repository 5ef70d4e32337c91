"""A `vlmserve encoder` process for tests, and a minimal engine speaking the wire protocol by hand."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cache import EmbeddingKey, codec
from encoder.tier import wire
from encoder.tier.workers import HOOK_ENV
from preprocess import PreprocessConfig, preprocess
from preprocess.hashing import DEFAULT_HASH, image_hash
from tests.support import REPO


@dataclass
class Pool:
    proc: subprocess.Popen
    tcp_url: str
    socket_path: str
    hooks: Path
    token: bytes | None = None  # the pool's --auth-token-file secret

    def hold(self) -> None:
        """Workers stop at the start of their next batch until ``release``."""
        (self.hooks / "hold").touch()

    def release(self) -> None:
        (self.hooks / "hold").unlink(missing_ok=True)

    def hold_only(self, pid: int) -> None:
        """The worker ``pid`` holds its batch until the test ends; every other worker runs freely."""
        (self.hooks / f"hold-{pid}").touch()  # NOTE: before the release, so that worker never runs free
        self.release()

    def started_batches(self) -> list[tuple[int, int]]:
        """(worker pid, batch number) of every batch a worker has begun."""
        out = []
        for p in self.hooks.glob("batch-*"):
            _, pid, n = p.name.split("-")
            out.append((int(pid), int(n)))
        return sorted(out)

    def stats(self) -> dict:
        deadline = time.monotonic() + 60
        while True:
            with RawEngine(self.socket_path, token=self.token) as eng:
                if eng.hello.get("kind") != "busy":  # all connections taken: one closes soon (a test's)
                    wire.send(eng.sock, {"op": "stats"})
                    header, _, _ = eng.reader.read()
                    return header
            assert time.monotonic() < deadline, "the pool never had a connection free for its stats"
            time.sleep(0.05)

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "") -> dict:
        """Poll the pool's stats until ``predicate`` holds (a bound against hanging, not a pace)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if predicate(st):
                return st
            assert time.monotonic() < deadline, f"pool never reached {what}: {st}"
            time.sleep(0.05)

    def wait_batch_started(self, before: list[tuple[int, int]], timeout: float = 120.0) -> tuple[int, int]:
        """The first batch begun that is not in ``before``."""
        deadline = time.monotonic() + timeout
        while not (new := sorted(set(self.started_batches()) - set(before))):
            assert time.monotonic() < deadline, "no worker started a batch"
            time.sleep(0.02)
        return new[0]

    def stop_holding(self) -> None:
        self.release()
        for held in self.hooks.glob("hold-*"):
            held.unlink(missing_ok=True)

    def stop(self) -> None:
        self.stop_holding()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def running_pool(tmp_path_factory, ckpt: Path, name: str, *extra: str):
    """A module fixture's body: a pool started in a temp directory of its own, stopped after the module."""
    p = start_pool(tmp_path_factory.mktemp(name), ckpt, *extra)
    yield p
    p.stop()


def assert_fell_back(resp, fallback: str, want: str | None = None) -> None:
    """A request whose pool failed it: with ``fail`` a 503 saying so (with Retry-After), with ``local`` a 200
    answered in-process (``want``: its text, where the test knows it)."""
    if fallback == "fail":
        assert resp.status_code == 503, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["code"] == "encoder_unavailable"
    else:
        assert resp.status_code == 200, resp.text
        if want is not None:
            assert resp.json()["choices"][0]["message"]["content"] == want


def start_pool(
    tmp: Path, ckpt: Path, *extra: str, socket_path: bool = True, token: bytes | None = None, env=None
) -> Pool:
    """``socket_path``: give the pool ``--socket`` in ``tmp`` (else its default); ``token``: its secret, in a
    file of mode 600 (``--auth-token-file``); ``env``: more environment for it."""
    hooks = tmp / "hooks"
    hooks.mkdir(exist_ok=True)
    env = {**os.environ, HOOK_ENV: str(hooks), "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-m", "api.cli", "encoder", "--model", str(ckpt), "--port", "0"]
    if socket_path:
        cmd += ["--socket", str(tmp / "encoder.sock")]
    if token is not None:
        (token_file := tmp / "token").write_bytes(token)
        token_file.chmod(0o600)
        cmd += ["--auth-token-file", str(token_file)]
    proc = subprocess.Popen([*cmd, *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("vlmserve encoder ready"):
        proc.kill()
        raise RuntimeError(f"encoder pool did not start: {line!r} (exit {proc.wait()})")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    tcp = next(w for w in line.split() if w.startswith("tcp://"))
    unix = next(w for w in line.split() if w.startswith("unix://")).removeprefix("unix://")
    return Pool(proc, tcp, unix, hooks, token)


class RawEngine:
    """An engine reduced to the protocol: hello, encode requests, results (shared memory by default).

    ``address``: a Unix socket path, or ``tcp://host:port``. ``hello`` is the pool's answer to the hello (an
    ``"op": "error"`` frame when it refused the connection)."""

    def __init__(
        self, address: str, ship: str = "shm", rcvbuf: int | None = None, token: bytes | None = None
    ) -> None:
        if address.startswith("tcp://"):
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if (
                rcvbuf is not None
            ):  # NOTE: before connecting, so the window it advertises is small from the start
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.connect((host, int(port)))
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(address)
        self.reader = wire.Reader(self.sock)
        nonce = secrets.token_hex(32)
        wire.send(self.sock, {"op": "hello", "ship": ship, "nonce": nonce})
        self.hello, _, _ = self.reader.read()
        if self.hello.get("op") == "challenge" and token is not None:  # prove the secret
            from encoder.tier import auth

            wire.send(
                self.sock, {"op": "auth", "proof": auth.proof(token, "engine", nonce, self.hello["nonce"])}
            )
            self.hello, _, _ = self.reader.read()

    def key(self, data: bytes, config: PreprocessConfig) -> EmbeddingKey:
        grid = tuple(preprocess(data, config).grid_thw)
        return EmbeddingKey(image_hash(data), grid, self.hello["preprocess"], self.hello["model"])

    def encode(self, rid: int, key: EmbeddingKey, data: bytes) -> None:
        wire.send(self.sock, {"op": "encode", "id": rid, "key": wire.key_to_json(key)}, data)

    def result(self, key_of: dict[int, EmbeddingKey]) -> tuple[int, torch.Tensor | None, dict]:
        header, payload, fd = self.reader.read()
        rid = header["id"]
        if "error" in header or header.get("via") == "redis":  # the embedding waits in Redis
            return rid, None, header
        digest = key_of[rid].digest()
        raw = wire.read_fd(fd, header["size"]) if fd is not None else payload
        return rid, codec.decode(digest, raw), header

    def close(self) -> None:
        self.sock.close()
        self.reader.close()

    def __enter__(self) -> RawEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FakePool:
    """A pool that answers every encode with ``entry(key)`` (on a Unix socket in ``tmp``): a pool gone wrong,
    or something posing as one. Inline, or with ``redis`` (a client): written there, and the engine told
    to read it."""

    def __init__(
        self, tmp: Path, preprocess_fp: str, model_fp: str, entry, redis=None, prefix: str = ""
    ) -> None:
        self.path = str(tmp / "fake.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.hello = {
            "op": "hello",
            "ship": "inline" if redis is None else "redis",
            "model": model_fp,
            "preprocess": preprocess_fp,
            "hash": DEFAULT_HASH,
        }
        self.entry, self.redis, self.prefix = entry, redis, prefix
        self.served = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        reader = wire.Reader(sock)
        try:
            while True:
                header, _payload, _ = reader.read()
                if header.get("op") == "hello":
                    wire.send(sock, self.hello)
                elif header.get("op") == "encode":
                    key = wire.key_from_json(header["key"], DEFAULT_HASH)
                    data = self.entry(key)
                    reply = {"op": "result", "id": header["id"], "size": len(data), "via": "inline"}
                    if self.redis is not None:
                        self.redis.set(f"{self.prefix}emb:{key.digest()}", data)
                        wire.send(sock, {**reply, "via": "redis"})
                    else:
                        wire.send(sock, reply, data)
                    self.served += 1
        except (EOFError, OSError, wire.ProtocolError):
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self.listener.close()
