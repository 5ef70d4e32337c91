"""The vision pipeline: embedding-cache lookup, preprocessing in the CPU pool, batched encoding.

Items arrive from the engine thread through ``request()``, which never blocks. A lookup thread checks the
embedding cache (memory, then Redis); misses go to the preprocess pool; finished patches queue for the
encoder thread, which packs pending images from all requests into one varlen batch (a patch budget and a
short wait), runs the vision tower + merger once, splits the rows per image, fills the cache and hands
each embedding to every item waiting for that key. Identical images in flight are encoded once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from cache import EmbeddingCache
from preprocess import PixelPatches, PreprocessConfig, PreprocessPool, preprocess

log = logging.getLogger("vlmserve.encoder")


def vision_fingerprint(tower: torch.nn.Module) -> str:
    """xxh3_128 over the vision weights (names, dtypes, shapes, bytes): what an embedding depends on."""
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
    batch_images: list[int] = field(default_factory=list)  # recent batch sizes (bounded)

    def record_batch(self, images: int, patches: int, seconds: float) -> None:
        self.batches += 1
        self.images += images
        self.patches += patches
        self.encode_seconds += seconds
        self.batch_images.append(images)
        del self.batch_images[:-256]


@dataclass(slots=True)
class _Pending:
    key: str
    patches: np.ndarray | None  # None once handed to the vision tower
    grid: tuple[int, int, int]
    ekey: object


class VisionPipeline:
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
        on_ready: Callable[[], None] | None = None,
        is_fatal: Callable[[BaseException], bool] = lambda exc: False,
    ) -> None:
        self.encode = encode
        self.config = config
        self.merge_size = merge_size
        self.cache = cache
        self.pool = pool
        self.max_batch_patches = max_batch_patches
        self.max_wait_s = max_wait_s
        self.on_ready = on_ready
        self.is_fatal = is_fatal
        # A failure that leaves the device unusable (``is_fatal``): the engine stops on it instead of
        # failing image after image on a poisoned device.
        self.fatal: BaseException | None = None
        self.stats = EncoderStats()
        self._lock = threading.Lock()
        self._waiters: dict[str, list] = {}  # key → items waiting for it
        self._done = threading.Condition(self._lock)
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vlmserve-vision-lookup")
        self._closed = False
        self._thread = threading.Thread(target=self._encoder_loop, name="vlmserve-encoder", daemon=True)
        self._thread.start()

    # -- engine side ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._waiters)

    def request(self, items: list) -> None:
        """Start work for items lacking embeddings; each gets ``embedding`` or ``error`` set when done."""
        for item in items:
            if item.embedding is not None or item.error is not None:
                continue
            with self._lock:
                waiting = self._waiters.get(item.key_hex)
                if waiting is not None:
                    if not any(w is item for w in waiting):
                        waiting.append(item)
                    continue
                self._waiters[item.key_hex] = [item]
            self._lookups.submit(self._lookup, item)

    def wait(self, timeout: float) -> None:
        """Block the caller until some pending work finishes (or ``timeout``)."""
        with self._done:
            if self._waiters:
                self._done.wait(timeout)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._lookups.shutdown(wait=False, cancel_futures=True)

    # -- lookup + preprocessing ------------------------------------------------------------------------------
    def _lookup(self, item) -> None:
        try:
            if self.cache is not None:
                emb = self.cache.get(item.ekey)
                if emb is not None:
                    self.stats.cache_hits += 1
                    self._finish(item.key_hex, embedding=emb)
                    return
                self.stats.cache_misses += 1
            if self.pool is not None:
                fut = self.pool.submit_future(item.data, self.config, item.max_pixels)
                fut.add_done_callback(lambda f, it=item: self._preprocessed(it, f))
            else:
                self._enqueue(item, preprocess(item.data, self.config, item.max_pixels))
        except Exception as exc:  # a bad image fails its own requests only
            self._finish(item.key_hex, error=exc)

    def _preprocessed(self, item, fut: Future) -> None:
        try:
            self._enqueue(item, fut.result())
        except Exception as exc:
            self._finish(item.key_hex, error=exc)

    def _enqueue(self, item, px: PixelPatches) -> None:
        if tuple(px.grid_thw) != tuple(item.grid_thw):
            raise RuntimeError(f"preprocessing gave grid {px.grid_thw}, the prompt planned {item.grid_thw}")
        self._queue.put(_Pending(item.key_hex, px.patches, tuple(px.grid_thw), item.ekey))

    # -- batched encoding ------------------------------------------------------------------------------------
    def _next_batch(self) -> list[_Pending] | None:
        first = self._queue.get()
        if first is None:
            return None
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
            if patches + nxt.patches.shape[0] > self.max_batch_patches:
                self._queue.put(nxt)  # NOTE: it goes to the back; it leads the next batch soon enough
                break
            batch.append(nxt)
            patches += nxt.patches.shape[0]
        return batch

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
                self.stats.record_batch(len(batch), num_patches, time.perf_counter() - t0)
            except Exception as exc:
                log.exception("vision tower failed on a batch of %d images", len(batch))
                if self.is_fatal(exc):
                    self.fatal = exc
                for p in batch:
                    self._finish(p.key, error=exc)
                continue
            for p, emb in zip(batch, embeddings):
                if self.cache is not None:
                    self.cache.put(p.ekey, emb)
                self._finish(p.key, embedding=emb)

    def _finish(
        self, key: str, embedding: torch.Tensor | None = None, error: Exception | None = None
    ) -> None:
        with self._done:
            items = self._waiters.pop(key, [])
            for item in items:
                # NOTE: the error is set before the embedding so a reader never sees neither.
                if error is not None:
                    item.error = error
                    self.stats.errors += 1
                else:
                    item.embedding = embedding
            self._done.notify_all()
        if self.on_ready is not None:
            self.on_ready()
