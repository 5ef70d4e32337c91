"""The engine's side of the vision pipeline: the embeddings its live requests need, by image key.

A request holds the keys of its images from when it is added until it ends. An image is sent to the
encoder once (however many requests hold it, and only when a request needs its rows: one whose prefix-cache
hit covers the image needs no encoding), its result is kept while someone holds its key, and dropped when
the last holder lets go. Engine thread only: the pipeline's threads hand results over through
``EncoderClient.take_results``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import torch

from cache import EmbeddingKey
from cache.layout import EmbeddingLayout
from encoder import EncodeJob, EncoderClient
from lm_engine.sequence import ImageItem


class MalformedEmbedding(RuntimeError):
    """An embedding whose layout is not what the decoder reads for its key (a bad cache entry, a bad peer)."""


class EncodedImages:
    def __init__(
        self,
        pipeline: EncoderClient,
        place: Callable[[torch.Tensor], torch.Tensor],
        layout: EmbeddingLayout,
    ) -> None:
        self.pipeline = pipeline
        self.place = place  # onto the engine's device (an embedding read back from Redis is on the CPU)
        self.layout = layout  # what the decoder reads for a key
        self.ready: dict[EmbeddingKey, torch.Tensor] = {}
        self.failed: dict[EmbeddingKey, BaseException] = {}
        self._holders: Counter[EmbeddingKey] = Counter()
        self._requested: set[EmbeddingKey] = set()
        self.shared = 0  # images a new request found held by another live one: no lookup, no encoding

    def hold(self, images: Iterable[ImageItem]) -> None:
        for key in {im.key for im in images}:
            self.shared += key in self._holders
            self._holders[key] += 1

    def release(self, images: Iterable[ImageItem]) -> None:
        for key in {im.key for im in images}:
            self._holders[key] -= 1
            if self._holders[key] <= 0:
                del self._holders[key]
                self.ready.pop(key, None)
                self.failed.pop(key, None)

    def missing(self, images: Iterable[ImageItem]) -> list[ImageItem]:
        """Those of ``images`` with neither rows nor an error yet."""
        return [im for im in images if im.key not in self.ready and im.key not in self.failed]

    def request(self, images: list[ImageItem], data: dict[EmbeddingKey, bytes]) -> None:
        """Send the images not yet sent to the encoder; ``data`` gives up the bytes of those sent."""
        jobs = []
        for im in images:
            if im.key not in self._requested and im.key in data:
                self._requested.add(im.key)
                jobs.append(EncodeJob(im.key, data.pop(im.key), im.max_pixels, im.video))
        self.pipeline.submit(jobs)

    def collect(self) -> None:
        """Take the pipeline's finished results; keep those some request still holds."""
        for result in self.pipeline.take_results():
            self._requested.discard(result.key)
            if result.key not in self._holders:
                continue
            if result.error is not None:
                self.failed[result.key] = result.error
            elif (why := self._malformed(result.key, result.embedding)) is not None:
                # NOTE: checked where it enters: a wrong shape would otherwise fail the step of every request
                # batched with the one holding it.
                self.failed[result.key] = MalformedEmbedding(why)
            else:
                self.ready[result.key] = self.place(result.embedding)

    def _malformed(self, key: EmbeddingKey, emb: torch.Tensor) -> str | None:
        if not isinstance(emb, torch.Tensor):
            return f"the embedding is a {type(emb).__name__}, not a tensor"
        return self.layout.problem(key, emb)

    @property
    def waiting(self) -> bool:
        return bool(self._requested)

    def wait(self, timeout: float) -> None:
        """Block until the encoder finishes something (or ``timeout``): nothing else can run meanwhile."""
        if self._requested:
            self.pipeline.wait(timeout)
