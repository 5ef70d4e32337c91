"""The pool's worker process: requests over a pipe, image bytes and patches through shared memory.

The parent copies each request's encoded bytes into its inbox segment for this worker (pool.py's
_Inbox) and sends only the name, size and settings. The worker writes each result into one of its
shared-memory slots, and the parent hands that slot to the consumer as is (zero-copy); the parent
says which slots are free again with the next request. Slots are reused because a fresh tmpfs
segment costs a page fault and a zeroed page per 4 KiB, which measured slower than the
preprocessing itself. Slots are named "<base>_<id>" with ids counting up from 1; the worker creates
them (at most one per request) and retires idle ones beyond MAX_IDLE_SLOTS. The parent owns
unlinking: retired slots at once, the rest when the worker stops or dies (every id below the
reply's next_id, and next_id itself, which a dying request may have just created).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from preprocess.config import PreprocessConfig
from preprocess.errors import PreprocessError
from preprocess.image import PixelPatches, _patchify_kernel, preprocess_into, trust_pil_resize
from preprocess.video import VideoJob, preprocess_video_into

READY = "ready"
MAX_IDLE_SLOTS = 2  # free slots a worker keeps mapped for reuse; more are retired, smallest first
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Job:
    """Parent → worker: preprocess the ``size`` bytes in inbox segment ``inbox``."""

    inbox: str
    size: int
    config: PreprocessConfig | VideoJob  # a video's settings and plan, for video bytes
    max_pixels: int | None
    released: list[int]  # slot ids the parent's consumers are done with


@dataclass(frozen=True, slots=True)
class Done:
    """Worker → parent: the patches are in slot ``slot``. Every reply says which slot id comes next and
    which slots the worker retired, so the parent always knows what to unlink."""

    next_id: int
    retired: list[int]
    slot: int
    shape: tuple[int, int]
    grid: tuple[int, int, int]
    seconds: float


@dataclass(frozen=True, slots=True)
class Failed:
    next_id: int
    retired: list[int]
    error: Exception


Reply = Done | Failed


def slot_name(base: str, slot: int) -> str:
    return f"{base}_{slot}"


def create_segment(name: str, min_size: int) -> SharedMemory:
    """A new shared-memory segment of at least `min_size` bytes (whole MiB), its pages reserved now.

    NOTE: tmpfs hands out pages on first write, and a write that finds /dev/shm full kills the
    writer with SIGBUS. Reserving up front turns that into an OSError (ENOSPC) here instead.
    """
    size = -(-max(min_size, 1) // _MIB) * _MIB
    shm = SharedMemory(name=name, create=True, size=size)
    try:
        os.posix_fallocate(shm._fd, 0, size)
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return shm


class Slots:
    """The worker's shared-memory slots: which exist, and which the parent has released."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.next_id = 1
        self.shms: dict[int, SharedMemory] = {}
        self.free: set[int] = set()
        self.retired: list[int] = []
        self.current: int | None = None  # the slot the request in hand writes to

    def release(self, ids) -> None:
        self.free.update(i for i in ids if i in self.shms)

    def array(self, shape: tuple[int, int]) -> np.ndarray:
        nbytes = math.prod(shape) * 4
        fits = [i for i in self.free if self.shms[i].size >= nbytes]
        if fits:
            slot = min(fits, key=lambda i: self.shms[i].size)
            self.free.remove(slot)
        else:
            slot = self.next_id
            self.next_id += 1
            self.shms[slot] = create_segment(slot_name(self.base, slot), nbytes)
        self.current = slot
        while len(self.free) > MAX_IDLE_SLOTS:
            self._retire(min(self.free, key=lambda i: self.shms[i].size))
        return np.ndarray(shape, dtype=np.float32, buffer=self.shms[slot].buf)

    def abandon_current(self) -> None:
        """The request failed after taking a slot: nobody holds it."""
        if self.current is not None:
            self.free.add(self.current)
            self.current = None

    def take_retired(self) -> list[int]:
        retired, self.retired = self.retired, []
        return retired

    def _retire(self, slot: int) -> None:
        self.free.remove(slot)
        self.shms.pop(slot).close()  # the parent unlinks it when the reply names it
        self.retired.append(slot)


class Inbox:
    """The worker's mapping of the parent's input segment (pool.py's _Inbox)."""

    def __init__(self) -> None:
        self.name = ""
        self.shm: SharedMemory | None = None

    def read(self, name: str, size: int) -> bytes:
        if not name:
            return b""
        if name != self.name:
            if self.shm is not None:
                self.shm.close()
            self.shm = SharedMemory(name=name)  # the parent owns (and unlinks) it
            self.name = name
        return bytes(self.shm.buf[:size])


def worker_main(
    conn: Connection, slot_base: str, fault_prefix: bytes | None = None, pil_exact: bool = False
) -> None:
    """Serve jobs (see Job and Reply above) until the parent sends None or goes away. ``pil_exact``: the
    parent's pil_resize_matches_torchvision()."""
    # Ctrl-C reaches the whole process group; shutting workers down is the parent's call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm_up(pil_exact)
    slots = Slots(slot_base)
    inbox = Inbox()
    conn.send(READY)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        slots.release(request.released)
        data = inbox.read(request.inbox, request.size)
        if fault_prefix is not None and data.startswith(fault_prefix):
            _inject_fault(data[len(fault_prefix) :], slots)
        try:
            conn.send(handle(data, request.config, request.max_pixels, slots))
        except OSError:  # the parent is gone
            return


def handle(data: bytes, config: PreprocessConfig | VideoJob, max_pixels: int | None, slots: Slots) -> Reply:
    start = time.perf_counter()
    slots.current = None
    try:
        result = preprocess_media(data, config, max_pixels, slots.array)
    except Exception as e:
        slots.abandon_current()
        if isinstance(e, PreprocessError):
            # NOTE: a fresh copy without the traceback, whose frames would keep slot views alive.
            error: Exception = PreprocessError(e.code, e.message)
        else:
            # Rebuilt as a plain RuntimeError so the reply always unpickles in the parent.
            error = RuntimeError(f"preprocess failed: {type(e).__name__}: {e}")
        return Failed(slots.next_id, slots.take_retired(), error)
    shape, grid = result.patches.shape, result.grid_thw
    del result  # no view of the slot outlives the request: the slot may be retired later
    return Done(slots.next_id, slots.take_retired(), slots.current, shape, grid, time.perf_counter() - start)


def preprocess_media(
    data: bytes, config: PreprocessConfig | VideoJob, max_pixels: int | None, alloc
) -> PixelPatches:
    """An image's patches (``config``: the image settings) or a video's (``config``: a VideoJob)."""
    if isinstance(config, VideoJob):
        return PixelPatches(*preprocess_video_into(data, config.config, config.plan, alloc))
    return preprocess_into(data, config, max_pixels, alloc)


def _warm_up(pil_exact: bool) -> None:
    # NOTE: no torch here unless this worker resizes with it (nearest, or a PIL that rounds otherwise: see
    # trust_pil_resize); importing it cost each preprocessing forkserver ~3.5 s of CPU on a 2-core EPYC
    # before its first worker could start. Each worker keeps to one thread, torch included if it comes: the
    # pool's parallelism is its processes.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # preloaded by a forkserver that another pool's workers share
        sys.modules["torch"].set_num_threads(1)
    trust_pil_resize(pil_exact)
    _patchify_kernel()  # loads (or builds, once per machine) the compiled normalize + patchify


def _inject_fault(kind: bytes, slots: Slots) -> None:
    """Test-only (enabled by the pool's _fault_prefix): die or hang like a broken decoder would.

    "late-exit" creates a slot the parent has never heard of, writes into it and dies, so the
    parent's clean-up must find that segment by name. "wait:PATH" keeps the worker busy until the file
    PATH exists (then the request fails as the non-image it is), or dies after a minute without it.
    """
    if kind.startswith(b"late-exit"):
        biggest = max((shm.size for shm in slots.shms.values()), default=0)
        slots.array((1, biggest // 4 + 1))[:] = 1.0
        os._exit(3)
    if kind.startswith(b"exit"):
        os._exit(3)
    if kind.startswith(b"segv"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind.startswith(b"hang"):
        time.sleep(3600)
    if kind.startswith(b"wait:"):
        path, deadline = os.fsdecode(kind[len(b"wait:") :]), time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                os._exit(3)
            time.sleep(0.005)
