"""A sequence's state: its tokens, how many are computed, its block table and its image items."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, replace

import torch

from cache import EmbeddingKey
from lm_engine.sampling_params import SamplingParams
from lm_engine.structured import GrammarState
from preprocess.video import VideoJob


class SequenceStatus(enum.Enum):
    WAITING_FOR_IMAGES = "waiting_for_images"  # images it must prefill are still being encoded
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class ImageItem:
    """One image in a prompt, the one type it travels as: where its placeholder rows sit, and its identity.

    ``key`` (image bytes hash, patch grid, preprocessing, vision weights) names the image everywhere: the
    embedding cache and the encoder look its embedding up by it, prefix-cache block hashes include it, and
    the engine keeps the encoded rows under it while requests need them. Chunked prefill slices those rows.
    """

    offset: int  # of the first placeholder token in the prompt
    length: int  # placeholder tokens = embedding rows
    key: EmbeddingKey
    max_pixels: int | None = None  # the visual budget its grid was planned with
    # A video's: its settings and frame plan for the preprocessing worker (None: an image).
    video: VideoJob | None = None
    # First row of the key's embedding this span takes: Qwen3-VL puts each temporal patch of a video in a span
    # of its own (timestamp text between them), all of one key.
    rows_from: int = 0

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.key.grid

    @property
    def end(self) -> int:
        return self.offset + self.length


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
    client_key: str = ""  # who sent it: prefill is shared fairly between clients
    # Enters its first prefix-cache block's hash and key (vLLM's cache_salt): prefix reuse never crosses salts.
    cache_salt: str = ""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    # Its images are encoded past this many tokens: admitted only while the prefix cache covers the rest.
    images_ready_after: int = 0
    block_table: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks of the table already offered to the prefix index
    # (hash, key) of each full block of its tokens so far, chained; content-derived, so computed once.
    block_chain: list = field(default_factory=list)
    generator: torch.Generator | None = None
    logprobs: list | None = None  # TokenLogprob per generated token, when its params ask for them
    grammar: GrammarState | None = None  # its matcher, when its params constrain the output
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    first_admitted: bool = False

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
        """A sibling for choice ``index`` sharing everything computed so far (blocks are shared by the caller;
        its generator is its own)."""
        return replace(
            self,
            token_ids=list(self.token_ids),
            index=index,
            seq_id=next(_seq_ids),
            block_table=[],
            block_chain=list(self.block_chain),
            generator=None,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            grammar=None if self.grammar is None else self.grammar.fork(),
            num_preemptions=0,
            first_admitted=True,
        )
