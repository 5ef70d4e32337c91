"""What a request asks of the sampler, validated once at the door."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings are supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:  # NaN fails the comparison too
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")

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

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
