"""What a request asks of the sampler, validated once at the door."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Bounds on what one request may ask of every step it runs in (the API refuses more with a 400).
MAX_INT = 2**63 - 1  # integer fields fit an int64
MAX_LOGIT_BIAS = 300  # logit_bias entries, as the OpenAI API allows
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # each stop string; its window is searched after every token


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Logit adjustments, applied before the temperature (greedy rows see them too), as OpenAI and vLLM do:
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    repetition_penalty: float = 1.0  # prompt and generated tokens: positive logits ÷ it, negative × it
    min_tokens: int = 0  # EOS and stop_token_ids are barred until this many tokens were generated
    min_p: float = 0.0  # drop tokens below min_p × the likeliest token's probability (after the temperature)
    logprobs: int | None = (
        None  # None: none; k: each token's log-probability and the k likeliest alternatives
    )
    # Structured output: the grammar the output must match, as llguidance text (lm_engine/structured.py
    # makes it from a JSON schema, a regex, choices or Lark); tokens it does not allow are masked.
    grammar: str | None = None
    grammar_after: str | None = None  # the grammar applies once the output holds this (e.g. "</think>")
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k is None or (_is_int(self.top_k) and self.top_k < 0):
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Refuse what the engine cannot apply, here at the door: an exception inside a step would cost the
        request its batch's step (the engine isolates it, but at the price of re-running the step row by row)."""
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "min_p",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are supported")
        for s in self.stop:
            if not isinstance(s, str) or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must be text of at most {MAX_STOP_CHARS} characters")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or not 0 <= tok <= MAX_INT:
                raise ValueError(f"stop_token_ids must be token ids, got {tok!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.grammar is not None and self.min_tokens:
            # NOTE: a complete grammar allows only the end-of-sequence token, which min_tokens bars.
            raise ValueError("min_tokens cannot be combined with structured output")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        for tok, bias in self.logit_bias.items():
            if not _is_int(tok) or not 0 <= tok <= MAX_INT:
                raise ValueError(f"logit_bias keys must be token ids, got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {tok}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment is set (the sampler skips rows without)."""
        return bool(
            any(self.logit_bias.values())
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )

    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (token ids, values) on the CPU, built once: the sampler reads it every step."""
        if self._bias is None:
            items = [(t, b) for t, b in self.logit_bias.items() if b]
            ids = torch.tensor([t for t, _ in items], dtype=torch.long)
            self._bias = ids, torch.tensor([b for _, b in items], dtype=torch.float32)
        return self._bias

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object) -> None:
    """An integer that fits an int64 and is not negative: a larger one overflows the sampler's tensors."""
    if not _is_int(value) or not 0 <= value <= MAX_INT:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {value!r}")
