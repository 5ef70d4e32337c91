"""The engine's side of the encoder tier: the pipeline contract of ``VisionPipeline``, served by a pool.

``RemoteVisionPipeline`` looks a key up in the engine's embedding cache and sends the misses to the pool
(``vlmserve encoder``). Every key sent has a deadline: a pool that is unreachable, gone or slower than
``timeout_s`` never holds a request longer. Then the key is encoded by the engine's own in-process pipeline
(``fallback="local"``) or fails with ``EncoderUnavailable`` (``fallback="fail"``: a 503 with Retry-After).
The engine does not change: it calls submit / take_results / wait as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch

from cache import EmbeddingCache, EmbeddingKey, codec
from encoder.pipeline import Encoded, EncodeJob, EncoderStats, VisionPipeline
from encoder.tier import auth, wire
from encoder.tier.server import host_id
from preprocess import PreprocessError, PreprocessWorkerError
from preprocess.hashing import DEFAULT_HASH

log = logging.getLogger("vlmserve.encoder.tier")

SHIP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EncoderBatchFailed(RuntimeError):
    """The pool's worker died or hung on the batch that held this image: encoding it here could do the same to
    this engine, so the image fails (its request gets the error)."""


class EncoderUnavailable(RuntimeError):
    """The encoder pool did not answer in time and this engine does not encode locally (a 503)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class RemoteStats:
    sent: int = 0  # encode requests sent to the pool
    received: int = 0
    shipped_bytes: int = 0
    ship_seconds: list[int] = field(default_factory=lambda: [0] * (len(SHIP_BUCKETS) + 1))  # histogram
    ship_seconds_sum: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> keys encoded locally or failed
    connected: bool = False

    def observe(self, seconds: float, size: int) -> None:
        self.received += 1
        self.shipped_bytes += size
        self.ship_seconds_sum += seconds
        self.ship_seconds[
            next((i for i, b in enumerate(SHIP_BUCKETS) if seconds <= b), len(SHIP_BUCKETS))
        ] += 1


@dataclass(slots=True)
class _Sent:
    job: EncodeJob
    deadline: float
    sent_at: float = 0.0
    rid: int = 0


class RemoteVisionPipeline:
    """The :class:`~encoder.pipeline.EncoderClient` of an engine served by a ``vlmserve encoder`` pool; ``local``
    takes over where the pool cannot (``fallback``)."""

    def __init__(
        self,
        url: str,
        local: VisionPipeline,
        cache: EmbeddingCache | None,
        *,
        timeout_s: float = 30.0,
        fallback: str = "local",
        model_fingerprint: str = "",
        hash_algorithm: str = DEFAULT_HASH,
        reconnect_s: float = 1.0,
        owned: subprocess.Popen | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth_token: bytes | None = None,
    ) -> None:
        if fallback not in ("local", "fail"):
            raise ValueError(f"encoder fallback must be 'local' or 'fail', got {fallback!r}")
        self.url, self.local, self.cache = url, local, cache
        self.timeout_s, self.fallback, self.reconnect_s = timeout_s, fallback, reconnect_s
        self.owned, self.clock = owned, clock
        self.model_fingerprint, self.hash_algorithm = model_fingerprint, hash_algorithm
        self._token = auth_token
        self.remote = RemoteStats()
        self._cond = threading.Condition()
        self._sent: dict[EmbeddingKey, _Sent] = {}
        self._by_id: dict[int, EmbeddingKey] = {}
        self._results: list[Encoded] = []
        self._next_id = 0
        self._sock: socket.socket | None = None
        self._ship = "inline"
        self._send_lock = threading.Lock()
        self._retry_at = 0.0
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlmserve-encoder-client")
        local.on_finish = self._notify

    # -- the pipeline contract --------------------------------------------------------------------------
    @property
    def fatal(self) -> BaseException | None:
        return self.local.fatal

    @property
    def stats(self) -> EncoderStats:
        """The in-process encoder's own figures (fallbacks and cache lookups)."""
        return self.local.stats

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._sent) + len(self._results) + self.local.pending

    def submit(self, jobs: list[EncodeJob]) -> None:
        now = self.clock()
        # NOTE: videos stay local: the pool's wire carries an image's bytes and grid, and it recomputes an
        # image's identity from them; a video's identity also covers its frame plan.
        self.local.submit([job for job in jobs if job.video is not None])
        for job in (job for job in jobs if job.video is None):
            with self._cond:
                if job.key in self._sent:
                    continue
                self._sent[job.key] = _Sent(job, now + self.timeout_s)
            self._lookups.submit(self._lookup, job)

    def take_results(self) -> list[Encoded]:
        self._expire()
        with self._cond:
            results, self._results = self._results, []
        return results + self.local.take_results()

    def wait(self, timeout: float) -> None:
        """Until a result is ready, the local encoder finishes something, or the next deadline (``timeout``)."""
        with self._cond:
            if self._results:
                return
            if self._sent:
                first = min(s.deadline for s in self._sent.values())
                timeout = max(0.0, min(timeout, first - self.clock()))
            self._cond.wait(timeout)

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._disconnect("closing")
        self.local.close()
        if self.owned is not None:
            self.owned.terminate()
            try:
                self.owned.wait(10)
            except subprocess.TimeoutExpired:
                self.owned.kill()
            shutil.rmtree(os.path.dirname(urlsplit(self.url).path), ignore_errors=True)

    # -- sending ----------------------------------------------------------------------------------------
    def _lookup(self, job: EncodeJob) -> None:
        if self.cache is not None and (emb := self.cache.get(job.key, self.local.layout.problem)) is not None:
            self.local.stats.cache_hits += 1
            self._finish(job.key, Encoded(job.key, embedding=emb))
            return
        if self.cache is not None:
            self.local.stats.cache_misses += 1
        try:
            self._send(job)
        except OSError as exc:
            self._disconnect(f"the encoder pool is unreachable ({exc})")
            self._fall_back([job.key], "unreachable")

    def _send(self, job: EncodeJob) -> None:
        with self._send_lock:
            sock = self._connected()
            with self._cond:
                if job.key not in self._sent:
                    return  # expired meanwhile
                self._next_id += 1
                rid = self._next_id
                self._by_id[rid] = job.key
                sent = self._sent[job.key]
                sent.sent_at, sent.rid = self.clock(), rid
            header = {
                "op": "encode",
                "id": rid,
                "key": wire.key_to_json(job.key),
                "max_pixels": job.max_pixels,
            }
            wire.send(sock, header, job.data)
            self.remote.sent += 1

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self.clock() < self._retry_at:
            raise ConnectionRefusedError("the encoder pool was unreachable a moment ago")
        try:
            sock, reader, hello = self._open(self.url, "shm" if self.url.startswith("unix://") else None)
            if hello.get("ship") != "shm" and hello.get("host_id") == host_id() and hello.get("socket"):
                sock.close()  # same host: the Unix socket, where embeddings come as shared memory
                sock, reader, hello = self._open(f"unix://{hello['socket']}", "shm")
        except OSError:
            self._retry_at = self.clock() + self.reconnect_s
            raise
        self._ship, self._sock = hello["ship"], sock
        self.remote.connected = True
        threading.Thread(target=self._read_loop, args=(sock, reader), daemon=True).start()
        return sock

    def _open(self, url: str, ship: str | None) -> tuple[socket.socket, wire.Reader, dict]:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.reconnect_s + 1)
            sock.connect(parts.path)
        else:
            sock = socket.create_connection((parts.hostname, parts.port), timeout=self.reconnect_s + 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            want = ship or ("redis" if self.cache is not None and self.cache.l2 is not None else "inline")
            reader = wire.Reader(sock)
            hello = self._handshake(sock, reader, want)
            self._check_hello(hello)
        except (OSError, EOFError, wire.ProtocolError) as exc:
            sock.close()
            if isinstance(exc, ConnectionRefusedError):
                log.warning("refusing the encoder pool at %s: %s", url, exc)
                raise
            raise ConnectionError(f"encoder pool handshake failed: {exc}") from None
        sock.settimeout(None)
        return sock, reader, hello

    def _handshake(self, sock: socket.socket, reader: wire.Reader, ship: str) -> dict:
        """The pool's hello, after each side proved it holds the secret when this engine has one
        (``encoder.tier.auth``); ConnectionRefusedError when the pool refuses or cannot prove it."""
        mine = auth.new_nonce()
        wire.send(sock, {"op": "hello", "ship": ship, "nonce": mine})
        reply, _, _ = reader.read()
        if reply.get("op") == "challenge":
            if self._token is None:
                raise ConnectionRefusedError(
                    "the encoder pool wants a secret: give --encoder-auth-token-file"
                )
            theirs = str(reply.get("nonce", ""))
            if not auth.verify(self._token, "pool", mine, theirs, reply.get("proof")):
                raise ConnectionRefusedError("the encoder pool did not prove it holds the secret")
            wire.send(sock, {"op": "auth", "proof": auth.proof(self._token, "engine", mine, theirs)})
            reply, _, _ = reader.read()
        elif reply.get("op") == "hello" and self._token is not None:
            raise ConnectionRefusedError(
                "the encoder pool does not authenticate (no --auth-token-file), and this engine has a secret"
            )
        if reply.get("op") != "hello":
            raise ConnectionRefusedError(f"the encoder pool refused this engine: {reply.get('error', reply)}")
        return reply

    def _check_hello(self, hello: dict) -> None:
        """The pool must compute what this engine would: the same weights, the same preprocessing."""
        if hello.get("preprocess") != self.local.config.fingerprint():
            raise ConnectionRefusedError("the encoder pool preprocesses differently from this engine")
        if hello.get("hash") != self.hash_algorithm:
            raise ConnectionRefusedError(
                f"the encoder pool keys images with {hello.get('hash')}, not {self.hash_algorithm}"
            )
        if self.model_fingerprint and hello.get("model") != self.model_fingerprint:
            raise ConnectionRefusedError(
                "the encoder pool runs other vision weights (or dtype) than this engine"
            )

    # -- receiving --------------------------------------------------------------------------------------
    def _read_loop(self, sock: socket.socket, reader: wire.Reader) -> None:
        try:
            while True:
                header, payload, fd = reader.read()
                self._received(header, payload, fd)
        except (EOFError, OSError, wire.ProtocolError) as exc:
            if self._sock is sock:
                self._disconnect(f"the encoder pool connection ended ({exc})")
        finally:
            reader.close()

    def _received(self, header: dict, payload: bytes, fd: int | None) -> None:
        with self._cond:
            key = self._by_id.pop(int(header.get("id", -1)), None)
            sent = self._sent.get(key) if key is not None else None
        if sent is None:
            if fd is not None:
                os.close(fd)
            return  # a key that expired meanwhile: the local encoder has it
        if "error" in header:
            self._remote_error(key, header)
            return
        emb, lost = self._embedding(key, header, payload, fd)
        if emb is None:
            self._fall_back([key], lost)
            return
        self.remote.observe(self.clock() - sent.sent_at, int(header.get("size", 0)))
        if self.cache is not None:
            self.cache.put(key, emb)
        self._finish(key, Encoded(key, embedding=emb))

    def _embedding(
        self, key: EmbeddingKey, header: dict, payload: bytes, fd: int | None
    ) -> tuple[torch.Tensor | None, str]:
        """The key's embedding as the pool shipped it, checked like any entry read back (a malformed one
        would fail the engine step it joins); or None and why: "invalid" (malformed, or not this key's
        layout) or "lost" (unreadable, or gone from Redis: a bad entry there is counted by the Redis tier)."""
        via, check = header.get("via"), self.local.layout.problem
        try:
            if via == "redis" and self.cache is not None and self.cache.l2 is not None:
                # NOTE: the tier checks it, and deletes and counts a bad one, like an entry found by lookup.
                emb = self.cache.l2.get(key, check)
                return emb, "lost" if emb is None else ""
            if via == "shm" and fd is not None:
                emb = codec.decode(key.digest(), wire.read_fd(fd, int(header["size"])), key.levels)
            elif via == "inline":
                emb = codec.decode(key.digest(), payload, key.levels)
            else:
                return None, "lost"
        except codec.CorruptEntry as exc:
            log.warning("a malformed embedding from the encoder pool (%s); encoding it again", exc)
            return None, "invalid"
        except (OSError, KeyError, ValueError):
            log.warning("an embedding from the encoder pool was unreadable; encoding it here")
            return None, "lost"
        if (why := check(key, emb)) is not None:
            log.warning(
                "an embedding from the encoder pool does not fit its key (%s); encoding it again", why
            )
            return None, "invalid"
        return emb, ""

    def _remote_error(self, key: EmbeddingKey, header: dict) -> None:
        kind, message = header.get("kind"), str(header.get("error"))
        if kind == "preprocess":  # a bad image is bad everywhere: the client's 400
            code, text = header.get("code", "invalid_image"), message.rsplit(" [", 1)[0]
            self._finish(key, Encoded(key, error=PreprocessError(code, text)))
        elif kind == "preprocess_worker":
            self._finish(key, Encoded(key, error=PreprocessWorkerError(message)))
        elif kind == "batch_failed":
            self._finish(key, Encoded(key, error=EncoderBatchFailed(message)))
        elif kind == "ship":  # encoded, but it could not reach this engine (the pool's Redis is down)
            self._fall_back([key], "ship_failed")
        else:
            self._fall_back([key], "remote_error")

    # -- deadlines and fallbacks ------------------------------------------------------------------------
    def _expire(self) -> None:
        now = self.clock()
        with self._cond:
            late = [k for k, s in self._sent.items() if s.deadline <= now]
        if late:
            self._fall_back(late, "timeout")

    def _disconnect(self, why: str) -> None:
        with self._send_lock:
            sock, self._sock = self._sock, None
            if sock is not None:
                self._retry_at = self.clock() + self.reconnect_s
                sock.close()
        self.remote.connected = False
        with self._cond:
            keys = list(self._sent) if sock is not None else []
            self._by_id.clear()
        if keys:
            log.warning("%s; %d keys in flight go to the fallback (%s)", why, len(keys), self.fallback)
            self._fall_back(keys, "disconnected")

    def _fall_back(self, keys: list[EmbeddingKey], reason: str) -> None:
        jobs = []
        with self._cond:
            for key in keys:
                sent = self._sent.pop(key, None)
                if sent is not None:
                    self._by_id.pop(sent.rid, None)
                    jobs.append(sent.job)
                    self.remote.fallbacks[reason] = self.remote.fallbacks.get(reason, 0) + 1
        if not jobs:
            return
        if self.fallback == "local":
            self.local.submit(jobs)
            return
        error = EncoderUnavailable(
            f"the encoder pool did not deliver ({reason})", retry_after_s=self.reconnect_s
        )
        with self._cond:
            self._results += [Encoded(j.key, error=error) for j in jobs]
            self._cond.notify_all()

    def _finish(self, key: EmbeddingKey, result: Encoded) -> None:
        with self._cond:
            if self._sent.pop(key, None) is None:
                return
            self._results.append(result)
            self._cond.notify_all()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


def start_local_pool(
    model: str,
    workers: int,
    dtype: str,
    device: str,
    startup_s: float = 600,
    threads: int = 0,
    nice: int = 0,
    hash_algorithm: str = DEFAULT_HASH,
    auth_token_file: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """``vlmserve encoder`` as a child of this server, on a Unix socket in a directory only this user may
    enter (mkdtemp's 0700); returns it and its URL.

    ``nice``: the pool's lower CPU priority, so this server's decode loop preempts its encoding.
    ``auth_token_file``: the server's own secret, which it then expects this pool to prove too."""
    path = os.path.join(tempfile.mkdtemp(prefix="vlmserve-encoder-"), "encoder.sock")
    cmd = [sys.executable, "-m", "api.cli", "encoder", "--model", model, "--workers", str(workers)]
    cmd += ["--socket", path, "--dtype", dtype, "--device", device, "--exit-with-parent"]
    cmd += ["--threads", str(threads), "--nice", str(nice), "--hash-algorithm", hash_algorithm]
    cmd += ["--auth-token-file", auth_token_file] if auth_token_file else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + startup_s
    for line in proc.stdout:  # the ready line, or the end of its output if it failed
        if line.startswith("vlmserve encoder ready"):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining
            return proc, f"unix://{path}"
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the local encoder pool did not start (exit code {proc.wait()})")


def connect(
    config, local: VisionPipeline, cache: EmbeddingCache, model_fingerprint: str
) -> RemoteVisionPipeline:
    """The engine's pipeline for ``config.encoder_url``, or for a pool of ``config.encoder_workers`` started
    here (lm_engine.config.EngineConfig); ``local`` stays the fallback."""
    owned, url = None, config.encoder_url
    token_file = config.encoder_auth_token_file
    token = auth.read_token(token_file) if token_file else None  # NOTE: a bad file stops start-up
    if config.encoder_workers:
        owned, url = start_local_pool(
            config.model,
            config.encoder_workers,
            config.dtype,
            config.device,
            threads=config.encoder_threads,
            nice=config.encoder_nice,
            hash_algorithm=config.hash_algorithm,
            auth_token_file=token_file,
        )
    return RemoteVisionPipeline(
        url,
        local,
        cache,
        timeout_s=config.encoder_timeout_s,
        fallback=config.encoder_fallback,
        model_fingerprint=model_fingerprint,
        hash_algorithm=config.hash_algorithm,
        owned=owned,
        auth_token=token,
    )
