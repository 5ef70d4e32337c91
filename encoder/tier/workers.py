"""Encoder worker processes: each owns a vision tower and runs the batches the tier's pipeline packs.

A worker takes a batch (one JSON header and the packed patches as raw bytes over its pipe), runs the tower
and sends the rows back the same way. ``WorkerPool.encode`` has the pipeline's ``encode`` signature: it
borrows an idle worker and waits at most ``batch_timeout_s`` for the rows. A worker that dies mid-batch, or
does not finish it in time (then it is killed), is replaced, and the batch fails (its images get the error):
it is never run again on another worker, since an image that crashed or hung one tower would do the same to
the next, and one poisoned image must not take down the pool.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from preprocess import forkserver

log = logging.getLogger("vlmserve.encoder.tier")

# Test hook: with this set to a directory, a worker announces each batch as a file ``batch-<pid>-<n>`` and
# holds it while ``<dir>/hold`` or ``<dir>/hold-<pid>`` exists, so a test can kill or delay a worker mid-batch
# deterministically.
HOOK_ENV = "VLMSERVE_ENCODER_TEST_HOOKS"
forkserver.register(["torch", "encoder.tier.workers", "encoder.models", "encoder.pipeline"])
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WorkerDied(RuntimeError):
    """A worker process ended while it held a batch (the batch is not run again)."""


class BatchTimeout(RuntimeError):
    """A worker did not finish a batch within the pool's per-batch timeout (it was killed and replaced)."""


def load_vision(model_dir: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The vision tower + merger the engine's ModelRunner builds, alone."""
    from encoder.models import build_vision_tower, read_config
    from runtime.linear import pack_linears

    tower = build_vision_tower(read_config(model_dir), model_dir, dtype=dtype, device=device).eval()
    pack_linears(tower)
    return tower


def _hook(n: int) -> None:
    hooks = os.environ.get(HOOK_ENV)
    if not hooks:
        return
    Path(hooks, f"batch-{os.getpid()}-{n}").touch()
    while Path(hooks, "hold").exists() or Path(hooks, f"hold-{os.getpid()}").exists():
        time.sleep(0.01)


def _warm(tower: torch.nn.Module, model_dir: str, device: str) -> None:
    """One small image through the tower, so the first real batch does not pay the kernels' set-up."""
    from encoder.models import merge_size, read_config

    config = read_config(model_dir)
    merge, v = merge_size(config), config.get("vision_config") or {}
    dim = 3 * int(v.get("temporal_patch_size", 2)) * int(v.get("patch_size", 14)) ** 2
    side = 4 * merge
    with torch.no_grad():
        tower(torch.zeros(side * side, dim, device=device), torch.tensor([[1, side, side]], device=device))


def worker_main(conn, model_dir: str, dtype_name: str, device: str, threads: int) -> None:
    """A worker process: load the tower, say ready (with its fingerprint), then encode batches until EOF."""
    from encoder.pipeline import vision_fingerprint

    if threads > 0:
        torch.set_num_threads(threads)
    tower = load_vision(model_dir, _DTYPES[dtype_name], device)
    _warm(tower, model_dir, device)
    levels = int(getattr(tower, "levels", 0))
    hello = {
        "ready": True,
        "fingerprint": vision_fingerprint(tower),
        "levels": levels,
        "row_width": tower.out_dim * (1 + levels),
    }
    conn.send_bytes(json.dumps(hello).encode())
    n = 0
    while True:
        try:
            head = json.loads(conn.recv_bytes())
            raw = conn.recv_bytes()
        except EOFError:
            return
        n += 1
        _hook(n)
        try:
            pixels = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(head["shape"])
            with torch.no_grad():
                rows = tower(pixels.to(device), torch.tensor(head["grids"], device=device)).cpu().contiguous()
        except Exception as exc:  # a batch the tower rejects fails its images, not the worker
            conn.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            conn.send_bytes(b"")
            continue
        dtype = str(rows.dtype).removeprefix("torch.")
        conn.send_bytes(json.dumps({"shape": list(rows.shape), "dtype": dtype}).encode())
        conn.send_bytes(rows.view(-1).view(torch.uint8).numpy())


@dataclass(slots=True)
class _Worker:
    proc: mp.Process
    conn: object  # multiprocessing.connection.Connection
    index: int

    def stop(self) -> None:
        self.conn.close()
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


@dataclass(slots=True)
class PoolStats:
    worker_deaths: int = 0  # workers that ended while holding a batch (not the ones killed for a timeout)
    failed_batches: int = 0  # batches whose worker died under them
    timed_out_batches: int = 0
    busy: dict[int, int] = field(default_factory=dict)  # pid -> patches of the batch it holds


class WorkerPool:
    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        device: str,
        workers: int,
        threads: int,
        batch_timeout_s: float = 120.0,
    ) -> None:
        self.model_dir, self.device, self.threads = model_dir, device, threads
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.size = workers
        self.batch_timeout_s = batch_timeout_s
        self.stats = PoolStats()
        self.fingerprint: str | None = None
        self.levels = 0  # deepstack levels each embedding row carries (the tower's)
        self.row_width = 0  # an embedding row's width, every level included
        # NOTE: forked from the process's preloaded forkserver, never from this process (its torch threads
        # are running): a worker starts, or restarts after a crash, without importing torch again.
        self._ctx = forkserver.context()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: dict[int, _Worker] = {}
        self._lock = threading.Lock()
        self._closed = False
        starting = [self._spawn(i) for i in range(workers)]
        for w in starting:
            self._await_ready(w)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return sorted(w.proc.pid for w in self._all.values())

    def _spawn(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe()
        args = (child, self.model_dir, self.dtype_name, self.device, self.threads)
        proc = self._ctx.Process(
            target=worker_main, args=args, name=f"vlmserve-encoder-worker-{index}", daemon=True
        )
        proc.start()
        child.close()
        return _Worker(proc, parent, index)

    def _await_ready(self, w: _Worker) -> None:
        try:
            hello = json.loads(w.conn.recv_bytes())
        except EOFError:
            raise RuntimeError(
                f"encoder worker {w.index} exited while loading (code {w.proc.exitcode})"
            ) from None
        if self.fingerprint is None:
            self.fingerprint = hello["fingerprint"]
            self.levels, self.row_width = int(hello["levels"]), int(hello["row_width"])
        elif hello["fingerprint"] != self.fingerprint:
            raise RuntimeError("encoder workers loaded different vision weights")
        with self._lock:
            self._all[w.proc.pid] = w
        self._idle.put(w)

    def _replace(self, dead: _Worker) -> None:
        with self._lock:
            self._all.pop(dead.proc.pid, None)
        dead.stop()
        if self._closed:
            return
        try:
            self._await_ready(self._spawn(dead.index))
        except Exception:
            log.exception("could not restart encoder worker %d", dead.index)

    def encode(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Rows of every image of the batch (the pipeline's ``encode``); raises ``WorkerDied`` or
        ``BatchTimeout`` for a batch its worker did not survive or finish, without running it again."""
        head = json.dumps({"shape": list(pixels.shape), "grids": grid_thw.tolist()}).encode()
        raw = np.ascontiguousarray(pixels.numpy(), dtype=np.float32)
        images = len(grid_thw)
        w = self._idle.get()
        try:
            return self._run_on(w, head, raw, pixels.shape[0])
        except BatchTimeout:
            log.warning(
                "encoder worker %d (pid %d) did not finish a batch of %d images in %g s; replacing it",
                *(w.index, w.proc.pid, images, self.batch_timeout_s),
            )
            with self._lock:
                self.stats.timed_out_batches += 1
            w.proc.kill()
            threading.Thread(target=self._replace, args=(w,), daemon=True).start()
            raise BatchTimeout(
                f"the vision encoder did not finish a batch of {images} images within {self.batch_timeout_s:g} s"
            ) from None
        except (EOFError, OSError):
            log.warning(
                "encoder worker %d (pid %d) died on a batch of %d images; the batch fails, it is not run again",
                *(w.index, w.proc.pid, images),
            )
            with self._lock:
                self.stats.worker_deaths += 1
                self.stats.failed_batches += 1
            threading.Thread(target=self._replace, args=(w,), daemon=True).start()
            raise WorkerDied(
                f"an encoder worker died while encoding a batch of {images} images (not retried: an image that "
                "kills one worker would kill the next)"
            ) from None

    def _run_on(self, w: _Worker, head: bytes, raw: np.ndarray, patches: int) -> torch.Tensor:
        with self._lock:
            self.stats.busy[w.proc.pid] = patches
        try:
            w.conn.send_bytes(head)
            w.conn.send_bytes(raw)
            reply = json.loads(self._recv(w))
            body = self._recv(w)
        finally:
            with self._lock:
                self.stats.busy.pop(w.proc.pid, None)
        self._idle.put(w)
        if "error" in reply:
            raise RuntimeError(f"vision tower failed in the encoder worker: {reply['error']}")
        return torch.frombuffer(bytearray(body), dtype=_DTYPES[reply["dtype"]]).reshape(reply["shape"])

    def _recv(self, w: _Worker) -> bytes:
        # NOTE: poll is true on EOF too, so a dead worker is an EOFError here, not a timeout.
        if not w.conn.poll(self.batch_timeout_s):
            raise BatchTimeout
        return w.conn.recv_bytes()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._all.values())
            self._all.clear()
        for w in workers:
            w.stop()
