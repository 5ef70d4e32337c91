"""The pool's worker process: requests in over a pipe, patches out through shared memory.

Each worker writes its patches into one shared-memory arena that it reuses for every request
(a worker holds one request at a time, and the parent copies out before sending the next).
Reuse matters: a fresh tmpfs segment per image costs a page fault and a zeroed page per 4 KiB,
which measured slower than the preprocessing itself. The arena only grows, as generations
"<base>_<n>"; the parent owns unlinking: it unlinks a generation once a newer one appears, and
the last ones when the worker stops or dies.
"""

from __future__ import annotations

import math
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from preprocess.config import PreprocessConfig
from preprocess.errors import PreprocessError
from preprocess.image import preprocess_into

READY = "ready"
_MIB = 1 << 20

# ("ok", arena generation, patches shape, grid_thw, seconds) or ("error", arena generation, exception).
# NOTE: one request grows the arena at most once, so after a worker dies the only generation
# its parent may not have heard of is the one after the last reply.
Reply = tuple


def arena_name(base: str, generation: int) -> str:
    return f"{base}_{generation}"


class Arena:
    """The worker's growing shared-memory block."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.generation = 0
        self.shm: SharedMemory | None = None

    def array(self, shape: tuple[int, int]) -> np.ndarray:
        nbytes = math.prod(shape) * 4
        if self.shm is None or self.shm.size < nbytes:
            # Grow by at least 25% so slowly rising sizes do not regrow every request.
            size = max(nbytes, int((self.shm.size if self.shm else 0) * 1.25))
            size = -(-size // _MIB) * _MIB
            if self.shm is not None:
                self.shm.close()  # the parent unlinks it when it sees the new generation
            self.generation += 1
            self.shm = SharedMemory(name=arena_name(self.base, self.generation), create=True, size=size)
        return np.ndarray(shape, dtype=np.float32, buffer=self.shm.buf)


def worker_main(conn: Connection, arena_base: str, fault_prefix: bytes | None = None) -> None:
    """Serve (data, config, max_pixels) requests until the parent sends None or goes away."""
    # Ctrl-C reaches the whole process group; shutting workers down is the parent's call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm_up()
    arena = Arena(arena_base)
    conn.send(READY)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        data, config, max_pixels = request
        if fault_prefix is not None and data.startswith(fault_prefix):
            _inject_fault(data[len(fault_prefix) :], config, max_pixels, arena)
        try:
            conn.send(handle(data, config, max_pixels, arena))
        except OSError:  # the parent is gone
            return


def handle(data: bytes, config: PreprocessConfig, max_pixels: int | None, arena: Arena) -> Reply:
    start = time.perf_counter()
    try:
        result = preprocess_into(data, config, max_pixels, arena.array)
    except PreprocessError as e:
        # NOTE: a fresh copy without the traceback, whose frames would keep arena views alive.
        return ("error", arena.generation, PreprocessError(e.code, e.message))
    except Exception as e:
        # Rebuilt as a plain RuntimeError so the reply always unpickles in the parent.
        return ("error", arena.generation, RuntimeError(f"preprocess failed: {type(e).__name__}: {e}"))
    return ("ok", arena.generation, result.patches.shape, result.grid_thw, time.perf_counter() - start)


def _warm_up() -> None:
    # Pay torch's import before the first request, and keep each worker on one thread:
    # the pool's parallelism is its processes.
    try:
        import torch
        import torchvision.transforms.v2.functional  # noqa: F401
    except ImportError:
        return
    torch.set_num_threads(1)


def _inject_fault(kind: bytes, config: PreprocessConfig, max_pixels: int | None, arena: Arena) -> None:
    """Test-only (enabled by the pool's _fault_prefix): die or hang like a broken decoder would.

    "late-exit" grows the arena to a generation the parent has never heard of, writes into it and
    dies, so the parent's clean-up must find that segment by name.
    """
    if kind.startswith(b"late-exit"):
        size = arena.shm.size // 4 + 1 if arena.shm is not None else 1
        arena.array((1, size))[:] = 1.0
        os._exit(3)
    if kind.startswith(b"exit"):
        os._exit(3)
    if kind.startswith(b"segv"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind.startswith(b"hang"):
        time.sleep(3600)
