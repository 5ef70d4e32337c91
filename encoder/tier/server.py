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
from encoder.tier import wire
from encoder.tier.workers import BatchTimeout, WorkerDied, WorkerPool
from preprocess import PreprocessConfig, PreprocessPool

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
    batch_timeout_s: float = (
        120.0  # a worker that has not finished a batch by then is killed; its images fail
    )


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


class _Conn:
    """One engine connection: its socket, how it wants embeddings, and its waits (request ids by key)."""

    def __init__(self, sock: socket.socket, unix: bool) -> None:
        self.sock, self.unix = sock, unix
        self.ship = "inline"
        self.lock = threading.Lock()  # one sender at a time
        self.alive = True

    def send(self, header: dict, payload: bytes = b"", fd: int | None = None) -> bool:
        with self.lock:
            if not self.alive:
                return False
            try:
                wire.send(self.sock, header, payload, fd)
                return True
            except OSError:
                self.alive = False
                return False


class EncoderServer:
    def __init__(self, settings: TierSettings) -> None:
        from lm_engine.config import EngineConfig
        from lm_engine.models.registry import load_model_config

        self.settings = s = settings
        path = Path(s.model)
        model_config = load_model_config(path)
        dtype = EngineConfig(model=s.model, dtype=s.dtype, device=s.device).resolve_dtype(model_config.dtype)
        self.preprocess_config = PreprocessConfig.from_checkpoint(path)
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
            merge_size=model_config.spatial_merge_size,
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
        self._closed = threading.Event()
        self.address: tuple[str, int] | None = None
        self.host_id = host_id()

    # -- listening --------------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.settings
        if s.port is not None:
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
            threading.Thread(target=self._serve_conn, args=(_Conn(sock, unix),), daemon=True).start()

    def _serve_conn(self, conn: _Conn) -> None:
        reader = wire.Reader(conn.sock)
        try:
            while True:
                header, payload, fd = reader.read()
                if fd is not None:
                    os.close(fd)  # engines never send descriptors
                self._handle(conn, header, payload)
        except (EOFError, OSError, wire.ProtocolError) as exc:
            if not isinstance(exc, EOFError):
                log.info("dropping an engine connection: %s", exc)
        finally:
            self._forget(conn)
            reader.close()
            conn.sock.close()

    # -- requests ---------------------------------------------------------------------------------------
    def _handle(self, conn: _Conn, header: dict, payload: bytes) -> None:
        op = header.get("op")
        if op == "hello":
            conn.ship = self._ship_way(conn, header.get("ship"))
            conn.send(self._hello(conn))
        elif op == "encode":
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
        }

    def _encode(self, conn: _Conn, header: dict, payload: bytes) -> None:
        rid = int(header.get("id", 0))
        key = wire.key_from_json(header.get("key"))
        if (
            key.model_fingerprint != self.fingerprint
            or key.preprocess_fingerprint != self.preprocess_config.fingerprint()
        ):
            conn.send(
                {
                    "op": "result",
                    "id": rid,
                    "error": "this encoder pool serves other vision weights or preprocessing",
                    "kind": "mismatch",
                }
            )
            return
        max_pixels = header.get("max_pixels")
        with self._lock:
            self.stats.requests += 1
            waits = self._waits.get(key)
            if waits is not None:
                self.stats.joined += 1
                waits.append((conn, rid))
                return
            self._waits[key] = [(conn, rid)]
        self.pipeline.submit([EncodeJob(key, payload, int(max_pixels) if max_pixels is not None else None)])

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
                self._deliver(result, waits)

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
            if conn.ship == "shm":
                fd = wire.memfd_with(entry)
                try:
                    ok = conn.send({**header, "fd": True}, fd=fd)
                finally:
                    os.close(fd)  # the engine holds its own copy of the descriptor now
            else:
                ok = conn.send(header, entry)
            if ok:
                self._shipped(conn.ship, len(entry))

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
                if conn.send({"op": "result", "id": rid, "size": size, "via": "redis"}):
                    self._shipped("redis", size)

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
