"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why a request failed before it produced anything: its image was bad (400), or the encoder failed on
    a good one (500). The API answers with it as an OpenAI error body."""

    status: int
    message: str
    code: str
    param: str | None = None
    retry_after_s: float | None = None  # a 503's Retry-After


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the model (its raw logits' log-softmax, before any
    penalty, bias or temperature), with the ``top`` most likely tokens at that step: (id, text, logprob)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for them
    delta_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    visual_tokens: list[int] = field(default_factory=list)
    visual_levels: list[int] = field(default_factory=list)  # visual budget level per image (0 = full)
    video_tokens: int = 0  # of the visual tokens, those of videos
    metrics: dict = field(default_factory=dict)
    error: RequestError | None = None

    # Single-choice conveniences (choice 0).
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
