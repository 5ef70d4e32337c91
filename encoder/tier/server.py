"""``vlmserve encoder``: a pool of encoder worker processes serving encode requests from any number of engines.

Requests arrive as frames keyed by the embedding key (``wire``). The first request for a key starts it through
the existing pipeline (embedding cache, preprocess pool, varlen batches across requests and engines) with
one encoder thread per worker process; later requests for the same key only wait for it (single flight).
Each waiting engine gets the embedding its own way:

- ``shm``: a memfd with the ``cache.codec`` entry, passed over the Unix socket (same host);
- ``redis``: written to Redis in the L2 format with a TTL, the reply names only the key (other hosts); a
  thread of its own writes them, so a slow or dead Redis never holds up the other two ways. When the write
  fails (Redis down, the circuit breaker open, the queue of writes full) the engine is told at once
  (``"kind": "ship"``) and falls back as it is configured to;
- ``inline``: the ``cache.codec`` entry as the frame's payload (TCP, no Redis).

An engine that disconnects is forgotten at once: its waits are dropped, a key nobody else waits for is
cancelled if the tower has not taken it yet (never encoded), and a result nobody waits for any more is not
shipped anywhere, so nothing piles up for engines that are gone.

A connection is not trusted for anything it says: with a secret (``auth``) it is an engine only once it
proves it holds it; a key must match its bytes (the image hash is recomputed, the fingerprints and level
count compared, the grid checked by preprocessing); ``max_pixels`` is clamped to the pool's own maximum;
frames are read up to the preprocessing byte limit; connections up to ``max_connections``; and each
connection's frames go out through a queue and a writer of its own, so an engine that stops reading is
dropped without holding up anyone else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from cache import EmbeddingCache, EmbeddingKey, codec
from cache.redis_tier import RedisTier
from encoder.pipeline import Encoded, EncodeJob, VisionPipeline
from encoder.tier import auth, wire
from encoder.tier.workers import BatchTimeout, WorkerDied, WorkerPool
from preprocess import PreprocessConfig, PreprocessPool, image_hash
from preprocess.hashing import DEFAULT_HASH

log = logging.getLogger("vlmserve.encoder.tier")


def host_id() -> str:
    """Same value on the same running host: who may be sent a memory file descriptor."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + "@" + socket.gethostname()
    except OSError:
        return socket.gethostname()


@dataclass(slots=True)
class TierSettings:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    workers: int = 1
    threads: int = 0  # torch threads per worker (0: torch's default)
    host: str = "127.0.0.1"
    port: int | None = None
    socket_path: str | None = None
    preprocess_workers: int = 2
    cache_bytes: int = 256 << 20
    redis_url: str | None = None
    redis_key_prefix: str = "vlmserve:"
    redis_ttl_s: int = 600
    redis_timeout_s: float = 0.1  # per Redis call (connect and each command)
    redis_max_queue: int = 64  # embeddings waiting for their Redis write; past it engines are told at once
    max_batch_patches: int = 16384
    max_wait_ms: float = 2.0
    hash_algorithm: str = DEFAULT_HASH  # the engines' --hash-algorithm: keys hashed otherwise are refused
    batch_timeout_s: float = 120.0  # a worker past it on a batch is killed; the batch's images fail
    max_connections: int = 64  # engine connections at once; one more is told so and closed
    send_timeout_s: float = 10.0  # a frame an engine has not taken by then: the engine is dropped
    max_queued_bytes: int = 256 << 20  # frames waiting for one engine past which it is dropped
    handshake_timeout_s: float = 10.0  # from connect to a finished hello
    auth_token: bytes | None = field(default=None, repr=False)  # the secret engines must prove they hold


@dataclass(slots=True)
class TierStats:
    requests: int = 0
    joined: int = 0  # requests that found their key already in flight (single flight)
    shipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # per way
    shipped_bytes: int = 0
    dropped: int = 0  # results whose engines had all gone
    cancelled: int = 0  # keys whose engines had all gone before the tower took them (never encoded)
    disconnects: int = 0
    ship_failures: int = 0  # waits answered "could not ship" (Redis down, its queue full)
    connections: int = 0  # open now
    refused_connections: int = 0  # past max_connections
    auth_failures: int = 0  # connections that did not prove they hold the secret
    refused_keys: int = 0  # encode requests whose key does not match their bytes, or this pool's model
    clamped: int = 0  # encode requests whose max_pixels was above the pool's maximum
    slow_drops: int = 0  # engines dropped because they did not take their frames (send timeout, queue bound)


# What a queued frame is charged beyond its payload (its header, the queue's entry).
_FRAME_COST = 512


class _Conn:
    """One engine connection: its socket, how it wants embeddings, and the frames on their way to it.

    Frames queue here and a writer thread of the connection's own sends them, each within the send timeout,
    so whoever answers (the delivery thread, the Redis writer, the connection's reader) never waits for an
    engine that does not read. An engine whose queue passes its bound, or that takes no frame in time, is
    dropped; the others do not notice."""

    def __init__(self, server: EncoderServer, sock: socket.socket, unix: bool) -> None:
        self.server, self.sock, self.unix = server, sock, unix
        self.ship = "inline"
        self.alive = True
        # header, payload, as a memfd, (way, bytes) to count as shipped once written
        self._out: deque[tuple[dict, bytes, bool, tuple[str, int] | None]] = deque()
        self._queued = 0
        self._closing = False
        self._cv = threading.Condition()
        self._writer: threading.Thread | None = None

    def start_writer(self) -> None:
        self._writer = threading.Thread(target=self._write_loop, name="vlmserve-encoder-writer", daemon=True)
        self._writer.start()

    def send(
        self,
        header: dict,
        payload: bytes = b"",
        *,
        memfd: bool = False,
        shipped: tuple[str, int] | None = None,
    ) -> bool:
        """Queue a frame (``memfd``: its payload goes as a memory file on the Unix socket); never blocks.
        False when the engine is gone, or dropped now for not taking what it was sent."""
        cost = len(payload) + _FRAME_COST
        with self._cv:
            if not self.alive or self._closing:
                return False
            if self._queued + cost <= self.server.settings.max_queued_bytes:
                self._out.append((header, payload, memfd, shipped))
                self._queued += cost
                self._cv.notify()
                return True
            why = f"{self._queued} bytes of frames wait for it"
        self.drop(why)
        return False

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._out and self.alive and not self._closing:
                    self._cv.wait()
                if not self._out or not self.alive:
                    return
                header, payload, memfd, shipped = self._out[0]
            try:
                self._write(header, payload, memfd)
            except TimeoutError:
                self.drop(f"it took no frame for {self.server.settings.send_timeout_s:g} s")
                return
            except OSError:
                self.drop()
                return
            with self._cv:
                if self._out:
                    self._out.popleft()
                    self._queued -= len(payload) + _FRAME_COST
            if shipped is not None:
                self.server._shipped(*shipped)

    def _write(self, header: dict, payload: bytes, memfd: bool) -> None:
        if not memfd:
            wire.send(self.sock, header, payload)
            return
        fd = wire.memfd_with(payload)
        try:
            wire.send(self.sock, {**header, "fd": True}, fd=fd)
        finally:
            os.close(fd)  # the engine holds its own copy of the descriptor now

    def drop(self, slow: str | None = None) -> None:
        """Gone (``slow``: dropped for not taking its frames, and why): what is queued is not sent, and the
        connection's reader wakes to an error and forgets the engine."""
        with self._cv:
            was_alive, self.alive = self.alive, False
            self._out.clear()
            self._queued = 0
            self._cv.notify_all()
        if was_alive and slow is not None:
            log.warning("dropping an engine connection: %s", slow)
            with self.server._lock:
                self.server.stats.slow_drops += 1
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self, flush_s: float = 1.0) -> None:
        """Send what is queued (a last error, say) within ``flush_s``, then close the socket."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(flush_s)
        self.drop()
        self.sock.close()


class EncoderServer:
    def __init__(self, settings: TierSettings) -> None:
        from encoder.models import checkpoint_dtype, merge_size, read_config
        from runtime.dtypes import compute_dtype

        self.settings = s = settings
        path = Path(s.model)
        model_config = read_config(path)
        dtype = compute_dtype(s.dtype, checkpoint_dtype(model_config), s.device)
        self.preprocess_config = PreprocessConfig.from_checkpoint(path)
        # NOTE: an engine sends an image's bytes as received, which preprocessing accepts up to max_bytes.
        self.max_frame_payload = self.preprocess_config.max_bytes
        self.workers = WorkerPool(s.model, dtype, s.device, s.workers, s.threads, s.batch_timeout_s)
        self.fingerprint = self.workers.fingerprint
        self.redis = (
            RedisTier(
                s.redis_url,
                prefix=s.redis_key_prefix,
                ttl_s=s.redis_ttl_s,
                connect_timeout_s=s.redis_timeout_s,
                timeout_s=s.redis_timeout_s,
                async_puts=False,
            )
            if s.redis_url
            else None
        )
        self._redis_jobs: deque[tuple[Encoded, list[tuple[_Conn, int]]]] = deque()
        self._redis_cv = threading.Condition()
        self.cache = EmbeddingCache.create(s.cache_bytes)
        self.preprocess = PreprocessPool(s.preprocess_workers) if s.preprocess_workers > 0 else None
        self._wake = threading.Event()
        self.pipeline = VisionPipeline(
            self.workers.encode,
            self.preprocess_config,
            merge_size=merge_size(model_config),
            cache=self.cache,
            pool=self.preprocess,
            max_batch_patches=s.max_batch_patches,
            max_wait_s=s.max_wait_ms / 1000,
            encoder_threads=s.workers,
            on_finish=self._wake.set,
            row_width=self.workers.row_width,
            dtype=dtype,
        )
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._waits: dict[EmbeddingKey, list[tuple[_Conn, int]]] = {}
        self._listeners: list[socket.socket] = []
        self._refusing = threading.BoundedSemaphore(16)  # connections being told they are one too many
        self._closed = threading.Event()
        self.address: tuple[str, int] | None = None
        self.host_id = host_id()

    # -- listening --------------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.port is not None:
            auth.check_exposure(s.host, s.auth_token)
            tcp = socket.create_server((s.host, s.port), reuse_port=False)
            self.address = tcp.getsockname()[:2]
            self._listen(tcp, unix=False)
        if s.socket_path:
            with_suppressed_unlink(s.socket_path)
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.bind(s.socket_path)
            unix.listen(64)
            self._listen(unix, unix=True)
        threading.Thread(target=self._deliver_loop, name="vlmserve-encoder-deliver", daemon=True).start()
        if self.redis is not None:
            threading.Thread(target=self._redis_loop, name="vlmserve-encoder-redis", daemon=True).start()

    def _listen(self, sock: socket.socket, unix: bool) -> None:
        self._listeners.append(sock)
        threading.Thread(target=self._accept_loop, args=(sock, unix), daemon=True).start()

    def _accept_loop(self, listener: socket.socket, unix: bool) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            if not unix:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                admitted = self.stats.connections < self.settings.max_connections
                if admitted:
                    self.stats.connections += 1
                else:
                    self.stats.refused_connections += 1
            if admitted:
                conn = _Conn(self, sock, unix)
                threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()
            elif self._refusing.acquire(blocking=False):
                threading.Thread(target=self._refuse, args=(sock,), daemon=True).start()
            else:
                sock.close()  # a flood: no word for each

    def _refuse(self, sock: socket.socket) -> None:
        """Tell a connection past the limit why, then close it (after the peer's own close, or a second, so the
        reason is read rather than lost to a reset)."""
        n = self.settings.max_connections
        try:
            sock.settimeout(1.0)
            with contextlib.suppress(OSError):
                error = f"the encoder pool serves at most {n} connections; try again later"
                wire.send(sock, {"op": "error", "kind": "busy", "error": error})
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
        finally:
            sock.close()
            self._refusing.release()

    def _serve_conn(self, conn: _Conn) -> None:
        reader = wire.Reader(conn.sock, max_payload=0)  # nothing before the hello carries a payload
        try:
            try:
                conn.sock.settimeout(self.settings.handshake_timeout_s)
                # NOTE: a bound on the whole hello, not per read: a peer dripping a byte at a time would
                # otherwise hold one of the max_connections slots for as long as it likes.
                deadline = threading.Timer(self.settings.handshake_timeout_s, conn.drop)
                deadline.start()
                try:
                    self._handshake(conn, reader)
                finally:
                    deadline.cancel()
                # NOTE: from here the timeout bounds each frame sent (a reader's wait just times out again).
                conn.sock.settimeout(self.settings.send_timeout_s)
                reader.max_payload = self.max_frame_payload
                conn.start_writer()
                while conn.alive:
                    try:
                        header, payload, fd = reader.read()
                    except TimeoutError:
                        continue  # an engine with nothing to ask
                    if fd is not None:
                        os.close(fd)  # engines never send descriptors
                    self._handle(conn, header, payload)
            except wire.ProtocolError as exc:
                log.info("dropping an engine connection: %s", exc)
                self._tell(conn, {"op": "error", "kind": "protocol", "error": str(exc)})
        except (EOFError, OSError) as exc:
            if not isinstance(exc, EOFError) and conn.alive:
                log.info("dropping an engine connection: %s", exc)
        finally:
            reader.close()
            conn.close()  # NOTE: before forgetting it, which marks it gone: a last error frame goes first
            self._forget(conn)
            with self._lock:
                self.stats.connections -= 1

    def _tell(self, conn: _Conn, frame: dict) -> None:
        """A last frame before the connection closes: queued when the writer runs, else sent now (bounded)."""
        if conn._writer is not None:
            conn.send(frame)
        else:
            with contextlib.suppress(OSError):
                wire.send(conn.sock, frame)

    def _handshake(self, conn: _Conn, reader: wire.Reader) -> None:
        """The hello, and with a secret configured, the engine's proof that it holds it (``auth``); raises
        ProtocolError (the connection is told and closed) on anything else."""
        hello = self._read_first(reader, "hello")
        token = self.settings.auth_token
        if token is not None:
            engine_nonce, pool_nonce = hello.get("nonce"), auth.new_nonce()
            if not isinstance(engine_nonce, str) or not 32 <= len(engine_nonce) <= 128:
                engine_nonce = ""  # NOTE: an engine without a secret sends none; it fails below all the same
            mine = auth.proof(token, "pool", engine_nonce, pool_nonce)
            wire.send(conn.sock, {"op": "challenge", "nonce": pool_nonce, "proof": mine})
            answer = self._read_first(reader, "auth")
            if not auth.verify(token, "engine", engine_nonce, pool_nonce, answer.get("proof")):
                with self._lock:
                    self.stats.auth_failures += 1
                log.warning("refused an engine connection that did not prove it holds the secret")
                error = "authentication failed: this encoder pool needs its --auth-token-file secret"
                wire.send(conn.sock, {"op": "error", "kind": "auth", "error": error})
                raise EOFError  # told already; the connection closes without another word
        conn.ship = self._ship_way(conn, hello.get("ship"))
        wire.send(conn.sock, self._hello(conn))

    @staticmethod
    def _read_first(reader: wire.Reader, op: str) -> dict:
        header, _, fd = reader.read()
        if fd is not None:
            os.close(fd)
        if header.get("op") != op:
            raise wire.ProtocolError(f"expected {op!r}, got {header.get('op')!r}")
        return header

    # -- requests ---------------------------------------------------------------------------------------
    def _handle(self, conn: _Conn, header: dict, payload: bytes) -> None:
        op = header.get("op")
        if op == "encode":
            self._encode(conn, header, payload)
        elif op == "stats":
            conn.send({"op": "stats", **self.snapshot()})
        else:
            raise wire.ProtocolError(f"unknown op {op!r}")

    def _ship_way(self, conn: _Conn, asked: object) -> str:
        if asked == "shm" and conn.unix:
            return "shm"
        if asked == "redis" and self.redis is not None:
            return "redis"
        return "inline"

    def _hello(self, conn: _Conn) -> dict:
        return {
            "op": "hello",
            "ship": conn.ship,
            "model": self.fingerprint,
            "preprocess": self.preprocess_config.fingerprint(),
            "host_id": self.host_id,
            "socket": self.settings.socket_path,
            "hash": self.settings.hash_algorithm,
        }

    def _encode(self, conn: _Conn, header: dict, payload: bytes) -> None:
        rid = header.get("id", 0)
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise wire.ProtocolError(f"bad request id {rid!r}")
        key = wire.key_from_json(header.get("key"), self.settings.hash_algorithm)
        if refused := self._refusal(key, payload):
            with self._lock:
                self.stats.refused_keys += 1
            kind, why = refused
            conn.send({"op": "result", "id": rid, "error": why, "kind": kind})
            return
        max_pixels = header.get("max_pixels")
        if max_pixels is not None:
            if not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels <= 0:
                raise wire.ProtocolError(f"bad max_pixels {max_pixels!r}")
            if max_pixels > self.preprocess_config.max_pixels:
                max_pixels = self.preprocess_config.max_pixels  # the pool's budget caps what an engine asks
                with self._lock:
                    self.stats.clamped += 1
        with self._lock:
            self.stats.requests += 1
            waits = self._waits.get(key)
            if waits is not None:
                self.stats.joined += 1
                waits.append((conn, rid))
                return
            self._waits[key] = [(conn, rid)]
        self.pipeline.submit([EncodeJob(key, payload, max_pixels)])

    def _refusal(self, key: EmbeddingKey, payload: bytes) -> tuple[str, str] | None:
        """(kind, why) this pool will not encode ``payload`` under ``key``, or None. The key is the engine's
        word; what it names is recomputed here, or one engine could file its picture under another's image: the
        image hash from the bytes, the grid by preprocessing (the pipeline refuses a grid that differs)."""
        if (
            key.model_fingerprint != self.fingerprint
            or key.preprocess_fingerprint != self.preprocess_config.fingerprint()
            or key.levels != self.workers.levels
        ):
            return "mismatch", "this encoder pool serves other vision weights or preprocessing"
        if image_hash(payload, key.hash_algorithm) != key.image_hash:
            return "key", "the image's bytes do not hash to the key's image_hash"
        return None

    def _forget(self, conn: _Conn) -> None:
        """The engine is gone: drop its waits; a key no live engine waits for any more is cancelled unless the
        tower has it (then it finishes into the pool's cache only)."""
        conn.alive = False
        with self._lock:
            self.stats.disconnects += 1
            for key, waits in list(self._waits.items()):
                left = [w for w in waits if w[0] is not conn]
                # NOTE: under the lock, so an engine asking for this key meanwhile starts it afresh.
                if not left and len(waits) and self.pipeline.cancel(key):
                    del self._waits[key]
                    self.stats.cancelled += 1
                else:
                    self._waits[key] = left

    # -- results ----------------------------------------------------------------------------------------
    def _deliver_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            for result in self.pipeline.take_results():
                with self._lock:
                    waits = self._waits.pop(result.key, [])
                    if not waits:
                        self.stats.dropped += 1
                try:
                    self._deliver(result, waits)
                except Exception as exc:  # one result that cannot be shipped fails its own waits only
                    log.exception("could not ship an embedding")
                    self._deliver(Encoded(result.key, error=exc), waits)

    def _deliver(self, result: Encoded, waits: list[tuple[_Conn, int]]) -> None:
        if result.error is not None:
            exc = result.error
            err = {"op": "result", "error": str(exc) or type(exc).__name__, "kind": _error_kind(exc)}
            if code := getattr(exc, "code", None):
                err["code"] = code
            for conn, rid in waits:
                conn.send({**err, "id": rid})
            return
        by_redis = [w for w in waits if w[0].ship == "redis"]
        here = [w for w in waits if w[0].ship != "redis"]
        if by_redis:
            with self._redis_cv:
                queued = len(self._redis_jobs) < self.settings.redis_max_queue
                if queued:
                    self._redis_jobs.append((result, by_redis))
                    self._redis_cv.notify()
            if not queued:
                self._ship_failed(by_redis, "the encoder pool's Redis writes are behind")
        if not here:
            return
        entry = codec.encode(result.key.digest(), result.embedding, result.key.levels)
        for conn, rid in here:
            header = {"op": "result", "id": rid, "size": len(entry), "via": conn.ship}
            conn.send(header, entry, memfd=conn.ship == "shm", shipped=(conn.ship, len(entry)))

    def _redis_loop(self) -> None:
        """Writes embeddings for engines elsewhere to Redis, then tells them; apart from the delivery thread,
        so a Redis that hangs until its timeout holds no same-host engine."""
        while True:
            with self._redis_cv:
                while not self._redis_jobs and not self._closed.is_set():
                    self._redis_cv.wait()
                if self._closed.is_set():
                    return
                result, waits = self._redis_jobs[0]
            stored = self.redis.store(result.key, result.embedding)
            with self._redis_cv:
                self._redis_jobs.popleft()
            if not stored:
                self._ship_failed(waits, "the encoder pool could not write the embedding to Redis")
                continue
            size = result.embedding.nbytes
            for conn, rid in waits:
                conn.send({"op": "result", "id": rid, "size": size, "via": "redis"}, shipped=("redis", size))

    def _ship_failed(self, waits: list[tuple[_Conn, int]], why: str) -> None:
        for conn, rid in waits:
            conn.send({"op": "result", "id": rid, "error": why, "kind": "ship"})
        with self._lock:
            self.stats.ship_failures += len(waits)

    def _shipped(self, way: str, size: int) -> None:
        with self._lock:
            self.stats.shipped[way] += 1
            self.stats.shipped_bytes += size

    # -- introspection ----------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        st, ps, ws = self.pipeline.stats, self.workers.stats, self.workers
        with self._lock:
            waiting = sum(len(w) for w in self._waits.values())
            tier = {
                "requests": self.stats.requests,
                "joined": self.stats.joined,
                "shipped": dict(self.stats.shipped),
                "shipped_bytes": self.stats.shipped_bytes,
                "dropped": self.stats.dropped,
                "cancelled": self.stats.cancelled,
                "disconnects": self.stats.disconnects,
                "ship_failures": self.stats.ship_failures,
                "connections": self.stats.connections,
                "refused_connections": self.stats.refused_connections,
                "auth_failures": self.stats.auth_failures,
                "refused_keys": self.stats.refused_keys,
                "clamped": self.stats.clamped,
                "slow_drops": self.stats.slow_drops,
                "waiting": waiting,
                "keys_in_flight": len(self._waits),
            }
        with self._redis_cv:
            tier["redis_queue"] = len(self._redis_jobs)
        # NOTE: the Redis tier's own counters, its circuit breaker's state and opens included.
        tier["redis"] = self.redis.stats() if self.redis is not None else None
        return {
            **tier,
            "images_encoded": st.images,
            "batches": st.batches,
            "cache_hits": st.cache_hits,
            "pipeline_pending": self.pipeline.pending,
            "pipeline_queued": self.pipeline.queued,
            "worker_pids": ws.pids,
            "busy_workers": sorted(ps.busy),
            "worker_deaths": ps.worker_deaths,
            "failed_batches": ps.failed_batches,
            "timed_out_batches": ps.timed_out_batches,
        }

    def close(self) -> None:
        self._closed.set()
        with self._redis_cv:
            self._redis_cv.notify_all()
        for sock in self._listeners:
            sock.close()
        if self.settings.socket_path:
            with_suppressed_unlink(self.settings.socket_path)
        self.pipeline.close()
        self.workers.close()
        if self.preprocess is not None:
            self.preprocess.close()
        if self.redis is not None:
            self.redis.close()


def _error_kind(exc: BaseException) -> str:
    from preprocess import PreprocessError, PreprocessWorkerError

    if isinstance(exc, PreprocessError):
        return "preprocess"
    if isinstance(exc, PreprocessWorkerError):
        return "preprocess_worker"
    if isinstance(exc, (WorkerDied, BatchTimeout)):
        return "batch_failed"  # the engine must not encode it itself: it may crash or hang it too
    return "encoder"


def with_suppressed_unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _watch_parent(stop: threading.Event) -> None:
    parent = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != parent:  # the server that started this pool is gone (even by SIGKILL)
            stop.set()


def serve_forever(settings: TierSettings, exit_with_parent: bool = False) -> None:
    """Run until SIGTERM/SIGINT; prints one ready line with the addresses (launchers wait for it)."""
    import signal

    server = EncoderServer(settings)
    if server.preprocess is not None:
        server.preprocess.wait_ready(300)  # ready means ready to encode, not still spawning processes
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if exit_with_parent:
        threading.Thread(target=_watch_parent, args=(stop,), daemon=True).start()
    where = [f"tcp://{server.address[0]}:{server.address[1]}"] if server.address else []
    where += [f"unix://{settings.socket_path}"] if settings.socket_path else []
    print(f"vlmserve encoder ready: {settings.workers} workers on {' '.join(where)}", flush=True)
    try:
        stop.wait()
    finally:
        server.close()
