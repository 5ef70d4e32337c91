"""A sequence's state: its tokens, how many are computed, its block table and its image items."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from lm_engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class ImageItem:
    """One image's placeholder span in a prompt.

    ``key`` is the image's identity for caching: the embedding-cache key's digest (image bytes hash,
    grid, preprocessing config, model fingerprint), the same bytes that go into prefix-cache block
    hashes. ``embedding`` holds the connector output rows once encoded (set by the vision pipeline);
    chunked prefill slices it, never re-encodes it. ``error`` is set instead when the image fails.
    """

    offset: int
    length: int
    key: bytes
    grid_thw: tuple[int, int, int]
    image_hash: str = ""
    data: bytes | None = None  # the encoded image, until preprocessed
    max_pixels: int | None = None  # the visual budget the grid was planned with
    ekey: object = None  # cache.EmbeddingKey
    embedding: torch.Tensor | None = None
    error: Exception | None = None

    @property
    def key_hex(self) -> str:
        return self.key.decode()


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    images: list[ImageItem] = field(default_factory=list)
    # Per-token positions of the prompt ([axes, P]); generated token i sits at i + position_delta.
    positions: torch.Tensor | None = None
    position_delta: int = 0
    index: int = 0  # choice index within the request (n > 1)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks so far
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    first_admitted: bool = False
    client_key: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def position_rows(self, start: int, end: int) -> torch.Tensor:
        """Positions ([axes, end-start]) of tokens [start, end)."""
        assert self.positions is not None
        p = self.num_prompt_tokens
        if end <= p:
            return self.positions[:, start:end]
        gen = torch.arange(max(start, p), end, dtype=torch.long) + self.position_delta
        gen = gen.unsqueeze(0).expand(self.positions.shape[0], -1)
        if start >= p:
            return gen
        return torch.cat([self.positions[:, start:p], gen], dim=1)

    def fork(self, index: int) -> Sequence:
        """A sibling for choice ``index`` sharing everything computed so far (blocks are shared by the caller)."""
        child = Sequence(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            params=self.params,
            images=self.images,
            positions=self.positions,
            position_delta=self.position_delta,
            index=index,
        )
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.arrival_time = self.arrival_time
        child.first_admitted = True
        child.client_key = self.client_key
        return child
