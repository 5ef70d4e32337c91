"""The vision pipeline: embedding-cache lookup, preprocessing in the CPU pool, batched encoding.

Jobs (an image's key and bytes) arrive from the engine thread through ``submit()``, which never blocks. A
lookup thread checks the embedding cache (memory, then Redis); misses go to the preprocess pool; finished
patches queue for the encoder thread, which packs pending images from all requests into one varlen batch
(a patch budget and a short wait), runs the vision tower + merger once, splits the rows per image and fills
the cache. Each key's result (its rows, or the error) is collected by the engine with ``take_results()``.
A key already in flight is not started again, so identical images are encoded once. ``cancel(key)`` drops a
key whose patches the tower has not taken yet, wherever it waits (lookup, preprocessing, the encoder queue):
no result comes for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import xxhash

from cache import EmbeddingCache, EmbeddingKey, EmbeddingLayout
from preprocess import PixelPatches, PreprocessConfig, PreprocessPool
from preprocess.video import VideoJob
from preprocess.worker import preprocess_media

log = logging.getLogger("vlmserve.encoder")


def _new_array(shape: tuple[int, int]) -> np.ndarray:
    return np.empty(shape, dtype=np.float32)


def vision_fingerprint(tower: torch.nn.Module) -> str:
    """xxh3_128 over the vision weights (names, dtypes, shapes, bytes): what an embedding depends on.

    NOTE: xxh3 whatever --hash-algorithm says: the operator chooses the weights, no client does (and hashing
    gigabytes at start-up at ~10x blake3's speed matters); the key that carries it uses the chosen algorithm."""
    h = xxhash.xxh3_128()
    for name, tensor in sorted(tower.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass(slots=True)
class EncoderStats:
    batches: int = 0
    images: int = 0
    patches: int = 0
    encode_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    errors: int = 0
    cancelled: int = 0  # keys dropped before the tower took them
    batch_images: list[int] = field(default_factory=list)  # recent batch sizes (bounded)

    def record_batch(self, images: int, patches: int, seconds: float) -> None:
        self.batches += 1
        self.images += images
        self.patches += patches
        self.encode_seconds += seconds
        self.batch_images.append(images)
        del self.batch_images[:-256]


@dataclass(frozen=True, slots=True)
class EncodeJob:
    """An image to encode: its identity, its bytes as received, and the visual budget its grid came from."""

    key: EmbeddingKey
    data: bytes
    max_pixels: int | None = None
    video: VideoJob | None = None  # a video's settings and frame plan (None: an image)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A job's result: the image's embedding rows, or why there are none."""

    key: EmbeddingKey
    embedding: torch.Tensor | None = None
    error: BaseException | None = None


@dataclass(slots=True)
class _Ticket:
    """One submission of a key. Cancelled: its work is dropped at the next stage; started: in a batch for the
    tower, too late to cancel. Both change under the pipeline's lock only."""

    cancelled: bool = False
    started: bool = False
    future: Future | None = None  # its preprocessing, cancelled with it while still queued


@dataclass(slots=True)
class _Pending:
    """Preprocessed patches waiting for the encoder thread."""

    key: EmbeddingKey
    patches: np.ndarray | None  # None once handed to the vision tower (or dropped)
    grid: tuple[int, int, int]
    ticket: _Ticket


@runtime_checkable
class EncoderClient(Protocol):
    """What the engine asks of whatever encodes its images: this process's :class:`VisionPipeline`, or
    :class:`~encoder.tier.client.RemoteVisionPipeline` (a ``vlmserve encoder`` pool, with this process's
    pipeline as its fallback). Engine thread only, except where a method says otherwise."""

    @property
    def fatal(self) -> BaseException | None:
        """A failure that left the device unusable (the engine stops on it), or None."""

    @property
    def stats(self) -> EncoderStats:
        """The in-process encoder's figures."""

    @property
    def pending(self) -> int:
        """Keys submitted whose result has not been taken yet."""

    def submit(self, jobs: list[EncodeJob]) -> None:
        """Start each job's key (a key already in flight is not started again); never blocks."""

    def take_results(self) -> list[Encoded]:
        """The results finished since the last call (an embedding, or the error), each key once."""

    def wait(self, timeout: float) -> None:
        """Block until a result is ready or ``timeout`` seconds pass."""

    def close(self) -> None:
        """Stop its threads and connections; results not yet taken are dropped."""


class VisionPipeline:
    """The in-process :class:`EncoderClient`: cache lookup, preprocessing and the batched tower (module doc)."""

    def __init__(
        self,
        encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: PreprocessConfig,
        *,
        merge_size: int,
        cache: EmbeddingCache | None = None,
        pool: PreprocessPool | None = None,
        max_batch_patches: int = 16384,
        max_wait_s: float = 0.002,
        is_fatal: Callable[[BaseException], bool] = lambda exc: False,
        encoder_threads: int = 1,
        on_finish: Callable[[], None] | None = None,
        row_width: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.encode = encode
        # What an entry read back from the cache must look like (row_width: every deepstack level included).
        self.layout = EmbeddingLayout(merge_size, row_width, dtype)
        self.config = config
        self.merge_size = merge_size
        self.cache = cache
        self.pool = pool
        self.max_batch_patches = max_batch_patches
        self.max_wait_s = max_wait_s
        self.is_fatal = is_fatal
        self.on_finish = on_finish  # told after each result is ready (a pipeline's owner may wait elsewhere)
        # A failure that leaves the device unusable (``is_fatal``): the engine stops on it instead of
        # failing image after image on a poisoned device.
        self.fatal: BaseException | None = None
        self.stats = EncoderStats()
        self._lock = threading.Lock()
        self._in_flight: dict[EmbeddingKey, _Ticket] = {}
        self._results: list[Encoded] = []
        self._done = threading.Condition(self._lock)
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlmserve-vision-lookup")
        self._closed = False
        # NOTE: one encoder thread per concurrent ``encode`` call it may make (the encoder tier's worker
        # processes each take one); in-process there is one tower, so one thread.
        self._threads = [
            threading.Thread(target=self._encoder_loop, name=f"vlmserve-encoder-{i}", daemon=True)
            for i in range(max(1, encoder_threads))
        ]
        for t in self._threads:
            t.start()

    # -- engine side ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Keys submitted whose result has not been taken yet."""
        with self._lock:
            return len(self._in_flight) + len(self._results)

    @property
    def queued(self) -> int:
        """Preprocessed images waiting for the tower (cancelled ones included until the queue drops them)."""
        return self._queue.qsize()

    def submit(self, jobs: list[EncodeJob]) -> None:
        """Start the jobs whose key is not in flight already; never blocks."""
        for job in jobs:
            with self._lock:
                if job.key in self._in_flight:
                    continue
                ticket = self._in_flight[job.key] = _Ticket()
            self._lookups.submit(self._lookup, job, ticket)

    def cancel(self, key: EmbeddingKey) -> bool:
        """Drop ``key`` unless the tower has taken it: True if dropped (no result will come for it), False if
        it is not in flight or already running (its result comes as usual)."""
        with self._lock:
            ticket = self._in_flight.get(key)
            if ticket is None or ticket.started:
                return False
            ticket.cancelled = True
            del self._in_flight[key]
            self.stats.cancelled += 1
            future = ticket.future
        if future is not None:
            future.cancel()  # a no-op once a preprocess worker has it
        return True

    def take_results(self) -> list[Encoded]:
        """The results finished since the last call."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def wait(self, timeout: float) -> None:
        """Block the caller until a result is ready to take (or ``timeout``)."""
        with self._done:
            if not self._results and self._in_flight:
                self._done.wait(timeout)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._lookups.shutdown(wait=False, cancel_futures=True)

    # -- lookup + preprocessing ------------------------------------------------------------------------------
    def _lookup(self, job: EncodeJob, ticket: _Ticket) -> None:
        if ticket.cancelled:
            return
        try:
            if self.cache is not None:
                emb = self.cache.get(job.key, self.layout.problem)
                if emb is not None:
                    self.stats.cache_hits += 1
                    self._finish(Encoded(job.key, embedding=emb), ticket)
                    return
                self.stats.cache_misses += 1
            if self.pool is not None:
                fut = self.pool.submit_future(job.data, job.video or self.config, job.max_pixels)
                with self._lock:
                    ticket.future = fut
                    if ticket.cancelled:
                        fut.cancel()
                fut.add_done_callback(lambda f, job=job: self._preprocessed(job, ticket, f))
            else:
                px = preprocess_media(job.data, job.video or self.config, job.max_pixels, _new_array)
                self._enqueue(job, px, ticket)
        except Exception as exc:  # a bad image fails its own requests only
            self._finish(Encoded(job.key, error=exc), ticket)

    def _preprocessed(self, job: EncodeJob, ticket: _Ticket, fut: Future) -> None:
        if ticket.cancelled:
            return  # its patches (a lease on a worker's slot, if any) go with the future
        try:
            self._enqueue(job, fut.result(), ticket)
        except Exception as exc:
            self._finish(Encoded(job.key, error=exc), ticket)

    def _enqueue(self, job: EncodeJob, px: PixelPatches, ticket: _Ticket) -> None:
        if tuple(px.grid_thw) != job.key.grid:
            raise RuntimeError(f"preprocessing gave grid {px.grid_thw}, the prompt planned {job.key.grid}")
        self._queue.put(_Pending(job.key, px.patches, tuple(px.grid_thw), ticket))

    # -- batched encoding ------------------------------------------------------------------------------------
    def _next_batch(self) -> list[_Pending] | None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.put(None)  # for the other encoder threads
                return None
            with self._lock:
                if self._start(first):
                    break
        batch, patches = [first], first.patches.shape[0]
        deadline = time.monotonic() + self.max_wait_s
        while patches < self.max_batch_patches:
            remaining = deadline - time.monotonic()
            try:
                nxt = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)
                break
            with self._lock:
                if nxt.ticket.cancelled:
                    nxt.patches = None
                    continue
                if patches + nxt.patches.shape[0] > self.max_batch_patches:
                    self._queue.put(nxt)  # NOTE: it goes to the back; it leads the next batch soon enough
                    break
                self._start(nxt)
            batch.append(nxt)
            patches += nxt.patches.shape[0]
        return batch

    def _start(self, p: _Pending) -> bool:
        """Under the lock: mark ``p`` taken by the tower, or drop it (False) if it was cancelled."""
        if p.ticket.cancelled:
            p.patches = None
            return False
        p.ticket.started = True
        return True

    def _encoder_loop(self) -> None:
        while not self._closed:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                t0 = time.perf_counter()
                # NOTE: pool results are leased shared memory; a lone image is encoded in place, and
                # every lease ends here or with the batch, so the worker can reuse its slot.
                if len(batch) == 1:
                    pixels = torch.from_numpy(batch[0].patches)
                else:
                    pixels = torch.from_numpy(np.concatenate([p.patches for p in batch]))
                for p in batch:
                    p.patches = None
                grids = torch.tensor([p.grid for p in batch])
                rows = self.encode(pixels, grids)
                num_patches = pixels.shape[0]
                del pixels  # the last lease on a lone image's slot
                lengths = [int(np.prod(p.grid)) // self.merge_size**2 for p in batch]
                embeddings = [e.clone() for e in rows.split(lengths)]
                with self._lock:
                    self.stats.record_batch(len(batch), num_patches, time.perf_counter() - t0)
            except Exception as exc:
                log.exception("vision tower failed on a batch of %d images", len(batch))
                if self.is_fatal(exc):
                    self.fatal = exc
                for p in batch:
                    self._finish(Encoded(p.key, error=exc), p.ticket)
                continue
            for p, emb in zip(batch, embeddings):
                if self.cache is not None:
                    self.cache.put(p.key, emb)
                self._finish(Encoded(p.key, embedding=emb), p.ticket)

    def _finish(self, result: Encoded, ticket: _Ticket) -> None:
        with self._done:
            if ticket.cancelled:
                return  # dropped: nobody takes a result for it
            if self._in_flight.get(result.key) is ticket:
                del self._in_flight[result.key]
            self._results.append(result)
            if result.error is not None:
                self.stats.errors += 1
            self._done.notify_all()
        if self.on_finish is not None:
            self.on_finish()
