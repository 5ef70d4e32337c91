"""A process pool for preprocess(), with an asyncio front and crash isolation.

Each worker process has one pipe and one parent-side thread that feeds it one request at a
time, so a worker that dies or hangs fails exactly the request it held; its thread starts a
replacement and carries on. (concurrent.futures.ProcessPoolExecutor would instead fail every
pending request with BrokenProcessPool.) Patches come back through the worker's shared-memory
arena (see worker.py): only shape and grid are pickled, the parent copies the patches out, and
the parent unlinks every segment a worker created once it is outgrown or the worker is gone.
"""

from __future__ import annotations

import asyncio
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

from preprocess.config import PreprocessConfig
from preprocess.errors import PreprocessWorkerError
from preprocess.image import PixelPatches
from preprocess.worker import READY, arena_name, worker_main

log = logging.getLogger(__name__)

# Imported once in the forkserver, so each (re)started worker forks with them loaded.
_PRELOAD = ["preprocess.worker", "torch", "torchvision.transforms.v2.functional"]


@dataclass(slots=True)
class PoolStats:
    """Counters a metrics exporter can read; updated under the pool's lock."""

    images: int = 0
    errors: int = 0
    worker_restarts: int = 0
    total_seconds: float = 0.0  # parent-side wall time per request: send, preprocess, copy out

    @property
    def mean_seconds(self) -> float:
        done = self.images + self.errors
        return self.total_seconds / done if done else 0.0


@dataclass(slots=True)
class _Job:
    data: bytes
    config: PreprocessConfig
    max_pixels: int | None
    future: Future[PixelPatches]


class PreprocessPool:
    """`await pool.submit(data, config, max_pixels)` from asyncio, `pool.run(...)` without a loop.

    start_method is "forkserver" (default; restarts are fast forks of a preloaded server) or
    "spawn". Never "fork": the parent runs torch threads. timeout_s bounds one image; a worker
    over it is killed and replaced. on_latency(seconds) is called after every request.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        timeout_s: float | None = 120.0,
        on_latency: Callable[[float], None] | None = None,
        start_method: str = "forkserver",
        _fault_prefix: bytes | None = None,
    ) -> None:
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.num_workers = num_workers or min(4, os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self.on_latency = on_latency
        self.stats = PoolStats()
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(_PRELOAD)
        self._fault_prefix = _fault_prefix
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._arena_prefix = f"vlmpp_{os.getpid()}_{os.urandom(4).hex()}"
        # NOTE: itertools.count, not a generator: worker threads (re)start concurrently, and a
        # generator raises "already executing" when two threads step it at once.
        self._arena_ids = itertools.count()
        self._workers = [_Worker(self, i) for i in range(self.num_workers)]
        for w in self._workers:
            w.thread.start()

    # ------------------------------------------------------------------ public API

    async def submit(
        self, data: bytes, config: PreprocessConfig, max_pixels: int | None = None
    ) -> PixelPatches:
        """Preprocess in a worker; the event loop only waits on a future, it never blocks."""
        return await asyncio.wrap_future(self.submit_future(data, config, max_pixels))

    def run(self, data: bytes, config: PreprocessConfig, max_pixels: int | None = None) -> PixelPatches:
        """Blocking form of submit(), for callers without an event loop."""
        return self.submit_future(data, config, max_pixels).result()

    def submit_future(
        self, data: bytes, config: PreprocessConfig, max_pixels: int | None = None
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
    """One worker process, the parent thread that owns its pipe, and its arena mapping."""

    def __init__(self, pool: PreprocessPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.ready = threading.Event()
        self.proc: mp.process.BaseProcess | None = None
        self.conn: mp.connection.Connection | None = None
        self.arena_base = ""
        self.arena_generation = 0  # the newest generation a reply has told us about
        self.arena: SharedMemory | None = None  # our mapping of that generation
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
        assert self.conn is not None
        try:
            self.conn.send((job.data, job.config, job.max_pixels))
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
            if self.proc is None:  # lost mid-request; _reap() already removed its arena
                self._restart_quietly()
        self._follow_arena(reply[1])
        if reply[0] == "error":
            raise reply[2]
        _, _, shape, grid, _seconds = reply
        return PixelPatches(patches=self._copy_out(shape), grid_thw=grid)

    def _follow_arena(self, generation: int) -> None:
        """The worker grew its arena: unlink every older generation."""
        if generation == self.arena_generation:
            return
        self._close_arena()
        for old in range(max(1, self.arena_generation), generation):
            _unlink_quietly(arena_name(self.arena_base, old))
        self.arena_generation = generation

    def _copy_out(self, shape: tuple[int, int]) -> np.ndarray:
        if self.arena is None:
            self.arena = SharedMemory(name=arena_name(self.arena_base, self.arena_generation))
        view = np.ndarray(shape, dtype=np.float32, buffer=self.arena.buf)
        patches = view.copy()
        del view  # no export may outlive this call, or the arena could not be closed later
        return patches

    def _close_arena(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    def _drop_arenas(self) -> None:
        """Unlink the worker's segments: the last one we heard of and the one it may have grown to."""
        self._close_arena()
        if self.arena_base:
            for generation in (self.arena_generation, self.arena_generation + 1):
                if generation > 0:
                    _unlink_quietly(arena_name(self.arena_base, generation))
        self.arena_base, self.arena_generation = "", 0

    def _start(self) -> None:
        base = f"{self.pool._arena_prefix}_{next(self.pool._arena_ids)}"
        parent_conn, child_conn = self.pool._ctx.Pipe(duplex=True)
        proc = self.pool._ctx.Process(
            target=worker_main,
            args=(child_conn, base, self.pool._fault_prefix),
            name=f"vlmserve-preprocess-{self.index}",
            daemon=True,
        )
        proc.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        self.proc, self.conn = proc, parent_conn
        self.arena_base, self.arena_generation = base, 0
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
        """Join the worker (no zombie), remove its shared memory and forget it; returns its exit code."""
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
        self._drop_arenas()
        return code

    def _stop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):  # already dead: _reap() collects it
                self.conn.send(None)
        self._reap()


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
