"""A process pool for preprocess(), with an asyncio front and crash isolation.

Each worker process has one pipe and one parent-side thread that feeds it one request at a
time, so a worker that dies or hangs fails exactly the request it held; its thread starts a
replacement and carries on. (concurrent.futures.ProcessPoolExecutor would instead fail every
pending request with BrokenProcessPool.) The image's bytes go out through a shared-memory inbox
per worker, and patches come back in one of the worker's shared-memory
slots (see worker.py): only shape and grid are pickled, and the caller gets an array over the slot
itself, no copy. The slot is leased: it goes back to the worker when the last view of that array
(numpy or torch) is gone. A worker holds at most `leases_per_worker` leases; a result beyond that
is copied out, so a consumer that hoards results cannot pin unbounded shared memory. The parent
unlinks every segment: retired and outgrown ones at once, the rest when the worker stops or dies
(mappings still leased stay valid until released).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from preprocess import forkserver
from preprocess.config import PreprocessConfig
from preprocess.errors import PreprocessWorkerError
from preprocess.image import PixelPatches, pil_resize_matches_torchvision
from preprocess.video import VideoJob
from preprocess.worker import READY, Failed, Job, create_segment, slot_name, worker_main

log = logging.getLogger(__name__)

# Imported once in the forkserver, so each (re)started worker forks with it loaded (torch is not: a worker
# imports it only if it resizes with it, see worker._warm_up).
forkserver.register(["preprocess.worker"])


@dataclass(slots=True)
class PoolStats:
    """Counters a metrics exporter can read; updated under the pool's lock."""

    images: int = 0
    errors: int = 0
    worker_restarts: int = 0
    total_seconds: float = 0.0  # parent-side wall time per request: send, preprocess, reply
    copied: int = 0  # results copied out because their worker had leases_per_worker outstanding

    @property
    def mean_seconds(self) -> float:
        done = self.images + self.errors
        return self.total_seconds / done if done else 0.0


@dataclass(slots=True)
class _Job:
    data: bytes
    config: PreprocessConfig | VideoJob
    max_pixels: int | None
    future: Future[PixelPatches]


class PreprocessPool:
    """`await pool.submit(data, config, max_pixels)` from asyncio, `pool.run(...)` without a loop. ``config``
    is a ``PreprocessConfig`` for image bytes, a ``VideoJob`` (settings and plan) for video bytes.

    start_method is "forkserver" (default; restarts are fast forks of a preloaded server) or
    "spawn". Never "fork": the parent runs torch threads. timeout_s bounds one image; a worker
    over it is killed and replaced. on_latency(seconds) is called after every request.
    leases_per_worker bounds the zero-copy results a worker may have outstanding (see above).
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        timeout_s: float | None = 120.0,
        on_latency: Callable[[float], None] | None = None,
        start_method: str = "forkserver",
        leases_per_worker: int = 4,
        _fault_prefix: bytes | None = None,
    ) -> None:
        if leases_per_worker < 0:
            raise ValueError(f"leases_per_worker must be >= 0, got {leases_per_worker}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self.on_latency = on_latency
        self.leases_per_worker = leases_per_worker
        self.stats = PoolStats()
        self._ctx = forkserver.context() if start_method == "forkserver" else mp.get_context("spawn")
        self._fault_prefix = _fault_prefix
        self._pil_exact = pil_resize_matches_torchvision()  # settled here, once: the check needs torch
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._slot_prefix = f"vlmpp_{os.getpid()}_{os.urandom(4).hex()}"
        # NOTE: itertools.count, not a generator: worker threads (re)start concurrently, and a
        # generator raises "already executing" when two threads step it at once.
        self._process_ids = itertools.count()
        self._workers = [_Worker(self, i) for i in range(self.num_workers)]
        for w in self._workers:
            w.thread.start()

    # ------------------------------------------------------------------ public API

    async def submit(
        self, data: bytes, config: PreprocessConfig | VideoJob, max_pixels: int | None = None
    ) -> PixelPatches:
        """Preprocess in a worker; the event loop only waits on a future, it never blocks."""
        return await asyncio.wrap_future(self.submit_future(data, config, max_pixels))

    def run(
        self, data: bytes, config: PreprocessConfig | VideoJob, max_pixels: int | None = None
    ) -> PixelPatches:
        """Blocking form of submit(), for callers without an event loop."""
        return self.submit_future(data, config, max_pixels).result()

    def submit_future(
        self, data: bytes, config: PreprocessConfig | VideoJob, max_pixels: int | None = None
    ) -> Future[PixelPatches]:
        if max_pixels is not None and max_pixels <= 0:
            raise ValueError(f"max_pixels must be positive, got {max_pixels}")
        future: Future[PixelPatches] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("PreprocessPool is closed")
            self._jobs.put(_Job(data, config, max_pixels, future))
        return future

    @property
    def pending(self) -> int:
        """Requests queued and not yet picked up by a worker."""
        return self._jobs.qsize()

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for operators, and for tests that kill one)."""
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.pid is not None]

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started and imported its libraries (for benchmarks)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._workers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not w.ready.wait(left):
                return False
        return True

    def close(self) -> None:
        """Finish queued requests, stop the workers and reap them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._workers:
                self._jobs.put(None)
        for w in self._workers:
            w.thread.join()

    async def aclose(self) -> None:
        """close() from a coroutine, without blocking the event loop while workers finish."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internal

    def _record(self, seconds: float, ok: bool) -> None:
        with self._lock:
            self.stats.total_seconds += seconds
            if ok:
                self.stats.images += 1
            else:
                self.stats.errors += 1
        if self.on_latency is not None:
            try:
                self.on_latency(seconds)
            except Exception:
                log.exception("preprocess on_latency callback failed")


class _Worker:
    """One worker process, the parent thread that owns its pipe, and the parent's side of its slots."""

    def __init__(self, pool: PreprocessPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.ready = threading.Event()
        self.proc: mp.process.BaseProcess | None = None
        self.conn: mp.connection.Connection | None = None
        self.slots: _Slots | None = None
        self.inbox: _Inbox | None = None
        self.thread = threading.Thread(target=self._serve, name=f"preprocess-worker-{index}", daemon=True)

    def _serve(self) -> None:
        try:
            self._start()
        except Exception:
            log.exception("preprocess worker %d failed to start; will retry on its next request", self.index)
        while (job := self.pool._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            start = time.perf_counter()
            result: PixelPatches | None = None
            error: BaseException | None = None
            try:
                result = self._run(job)
            except BaseException as e:
                error = e
            # NOTE: stats before the future completes, so whoever awaits it sees them updated.
            self.pool._record(time.perf_counter() - start, error is None)
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
        self._stop()

    def _run(self, job: _Job) -> PixelPatches:
        if self.proc is None or not self.proc.is_alive():
            self._restart()  # died while idle (e.g. the OOM killer): not this request's fault
        assert self.conn is not None and self.slots is not None and self.inbox is not None
        slots = self.slots
        try:
            name = self.inbox.put(job.data)
        except OSError as e:  # e.g. /dev/shm full: this request fails, the worker is fine
            raise PreprocessWorkerError(f"no shared memory to pass the image to a worker: {e}") from None
        try:
            self.conn.send(Job(name, len(job.data), job.config, job.max_pixels, slots.take_released()))
            timeout = self.pool.timeout_s
            if not self.conn.poll(timeout):
                self._kill()
                raise PreprocessWorkerError(
                    f"preprocessing took longer than {timeout} s; the worker was killed and replaced"
                )
            reply = self.conn.recv()
        except (EOFError, OSError):
            how = _describe_exit(self._reap())
            raise PreprocessWorkerError(
                f"preprocess worker died ({how}) while handling this image; it was replaced"
            ) from None
        finally:
            if self.proc is None:  # lost mid-request; _reap() already unlinked its slots
                self._restart_quietly()
        slots.follow(reply.next_id, reply.retired)
        if isinstance(reply, Failed):
            raise reply.error
        patches, copied = slots.hand_out(reply.slot, reply.shape, self.pool.leases_per_worker)
        if copied:
            with self.pool._lock:
                self.pool.stats.copied += 1
        return PixelPatches(patches=patches, grid_thw=reply.grid)

    def _start(self) -> None:
        base = f"{self.pool._slot_prefix}_{next(self.pool._process_ids)}"
        parent_conn, child_conn = self.pool._ctx.Pipe(duplex=True)
        proc = self.pool._ctx.Process(
            target=worker_main,
            args=(child_conn, base, self.pool._fault_prefix, self.pool._pil_exact),
            name=f"vlmserve-preprocess-{self.index}",
            daemon=True,
        )
        proc.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        self.proc, self.conn = proc, parent_conn
        self.slots = _Slots(base)
        self.inbox = _Inbox(base)
        try:
            if parent_conn.recv() != READY:
                raise RuntimeError("preprocess worker sent an unexpected greeting")
        except (EOFError, OSError):
            how = _describe_exit(self._reap())
            raise RuntimeError(f"preprocess worker exited during start-up ({how})") from None
        self.ready.set()

    def _restart(self) -> None:
        self._reap()
        with self.pool._lock:
            self.pool.stats.worker_restarts += 1
        self._start()

    def _restart_quietly(self) -> None:
        try:
            self._restart()
        except Exception:
            log.exception(
                "preprocess worker %d failed to restart; will retry on its next request", self.index
            )

    def _kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        self._reap()

    def _reap(self) -> int | None:
        """Join the worker (no zombie), unlink its shared memory and forget it; returns its exit code."""
        self.ready.clear()
        code = None
        if self.proc is not None:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            code = self.proc.exitcode
            self.proc.close()
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None
        if self.slots is not None:
            self.slots.abandon()
            self.slots = None
        if self.inbox is not None:
            self.inbox.drop()
            self.inbox = None
        return code

    def _stop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):  # already dead: _reap() collects it
                self.conn.send(None)
        self._reap()


class _Inbox:
    """The request's encoded bytes go to the worker through shared memory, not the pipe.

    Through the pipe, a 6 MB PNG took ~100 socket-buffer round trips and four copies; here it is one
    copy in, one out. The segment only grows, by replacement: the old one is unlinked at once (the
    worker, which may still map it, switches when the next request names the new one).
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self.generation = 0
        self.shm: SharedMemory | None = None

    def put(self, data: bytes) -> str:
        """Copy `data` in; returns the segment's name ("" for empty data)."""
        if not data:
            return ""
        if self.shm is None or self.shm.size < len(data):
            self.drop()
            self.generation += 1
            # A quarter to spare, so slowly growing inputs do not replace it every request.
            self.shm = create_segment(f"{self.base}_in{self.generation}", len(data) * 5 // 4)
        self.shm.buf[: len(data)] = data
        return self.shm.name.lstrip("/")

    def drop(self) -> None:
        if self.shm is not None:
            self.shm.close()
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
            self.shm = None


class _Slots:
    """The parent's side of one worker process's slots: mappings, leases, what to unlink.

    Only the worker's parent thread calls these methods. Leases are released from whichever thread
    drops the last view, so they only append to a deque that this side drains.
    """

    def __init__(self, base: str) -> None:
        self.base = base
        self.next_id = 1  # the worker's next slot id, as its last reply said
        self.live: set[int] = set()  # ids below next_id not yet retired
        self.shms: dict[int, SharedMemory] = {}  # our mappings, kept for reuse (no page faults)
        self.leased: set[int] = set()
        self.released: collections.deque[int] = collections.deque()  # appended to by _Lease
        self._to_free: list[int] = []

    def take_released(self) -> list[int]:
        """Slots whose leases ended since the last call: the worker may write to them again."""
        self._collect()
        ids, self._to_free = self._to_free, []
        return ids

    def follow(self, next_id: int, retired: list[int]) -> None:
        self.live.update(range(self.next_id, next_id))
        self.next_id = next_id
        for slot in retired:
            self.live.discard(slot)
            shm = self.shms.pop(slot, None)
            if shm is not None:
                shm.close()  # free slots have no lease, so no view of them exists
            _unlink_quietly(slot_name(self.base, slot))

    def hand_out(self, slot: int, shape: tuple[int, int], max_leases: int) -> tuple[np.ndarray, bool]:
        """The result in `slot` as an array over it (leased), or a copy when leases are used up."""
        shm = self.shms.get(slot)
        if shm is None:
            shm = self.shms[slot] = SharedMemory(name=slot_name(self.base, slot))
        view = np.ndarray(shape, dtype=np.float32, buffer=shm.buf)
        self._collect()
        if len(self.leased) >= max_leases:
            patches = view.copy()
            self._to_free.append(slot)
            return patches, True
        self.leased.add(slot)
        return np.asarray(_Lease(view, shm, self.released, slot)), False

    def abandon(self) -> None:
        """The worker is gone: unlink every segment it may have made; close what no lease holds."""
        self._collect()
        for slot in self.live | {self.next_id}:
            shm = self.shms.pop(slot, None)
            if shm is None:
                _unlink_quietly(slot_name(self.base, slot))
                continue
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
            if slot not in self.leased:
                shm.close()
            # NOTE: a leased mapping stays open: its _Lease holds it, and closes it with its last view.
        self.live.clear()

    def _collect(self) -> None:
        while self.released:
            slot = self.released.popleft()
            self.leased.discard(slot)
            self._to_free.append(slot)


class _Lease:
    """The owner (numpy ``base``) of a result array that lies in a worker's slot.

    numpy keeps it alive through every view, and torch.from_numpy keeps those views alive, so its
    __del__ runs only when nothing can read the slot any more; then the slot goes back to the worker.
    """

    __slots__ = ("_view", "_shm", "_released", "_slot")

    def __init__(self, view: np.ndarray, shm: SharedMemory, released: collections.deque, slot: int) -> None:
        self._view = view
        self._shm = shm  # keeps the mapping open after the worker is gone
        self._released = released
        self._slot = slot

    @property
    def __array_interface__(self) -> dict:
        return self._view.__array_interface__

    def __del__(self) -> None:
        self._view = None  # the buffer export ends before the slot can be reused or closed
        self._released.append(self._slot)


def _unlink_quietly(name: str) -> None:
    try:
        shm = SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
