"""After sampling: each new token is detokenized and checked against the stop conditions, and each request
touched by the step gets a ``RequestOutput`` with what its choices added."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lm_engine.detokenizer import detokenize_step, flush
from lm_engine.outputs import CompletionOutput, RequestError, RequestOutput
from lm_engine.sampling_params import SamplingParams
from lm_engine.sequence import ImageItem, Sequence


@dataclass(slots=True)
class RequestState:
    """A request as the engine tracks it: its choices (one sequence each once forked) and what was sent."""

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    prompt_token_ids: list[int]
    images: list[ImageItem]
    image_data: dict = field(default_factory=dict)  # key → encoded bytes, until handed to the encoder
    emitted: dict[int, tuple[int, int]] = field(default_factory=dict)  # index → (tokens, chars) sent
    forked: bool = False
    ticket: object = None  # admission.Ticket, released once scheduled or ended

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(
        self,
        decode: Callable[..., str],
        eos_ids: set[int],
        max_model_len: int,
        level_of: Callable[[int | None], int],
    ) -> None:
        self.decode = decode
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.level_of = level_of

    def append(self, seq: Sequence, tok: int) -> bool:
        """Append ``tok``, extend the text, and apply the stop conditions; True when ``seq`` is done (its
        ``finish_reason`` set; the caller frees it)."""
        seq.token_ids.append(tok)
        p = seq.params
        detokenize_step(seq, self.decode)
        reason, stop_reason = None, None
        if seq.num_output_tokens < p.min_tokens:
            pass  # no stop condition before min_tokens (the sampler bars EOS and stop_token_ids too), as vLLM
        elif (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason, stop_reason = "stop", (tok if tok in p.stop_token_ids else None)
        elif p.stop:
            window = max(len(s) for s in p.stop) + 16
            text = seq.output_text
            for s in p.stop:
                idx = text.find(s, max(0, len(text) - window))
                if idx >= 0:
                    seq.output_text = text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                    reason, stop_reason = "stop", s
                    break
        if reason is None and p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        if not isinstance(stop_reason, str):
            flush(seq, self.decode)  # a stop string cut the text already; anything else ends it whole
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` for a reason of the caller's (its grammar is complete), its text whole."""
        flush(seq, self.decode)
        seq.finish_reason = reason

    def output(self, state: RequestState) -> RequestOutput:
        """What the request's choices hold now, with the deltas since its last output. Text that could still
        turn out to be the start of a stop string is held back until it cannot."""
        outs = []
        hold = max((len(s) for s in state.params.stop), default=1) - 1
        for seq in sorted(state.seqs, key=lambda s: s.index):
            sent_tokens, sent_chars = state.emitted.get(seq.index, (0, 0))
            text = seq.output_text
            visible = len(text) if seq.is_finished else max(sent_chars, len(text) - hold)
            token_ids = seq.output_token_ids
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    token_ids=list(token_ids),
                    text=text[:visible],
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=text[sent_chars:visible],
                    delta_token_ids=token_ids[sent_tokens:],
                    logprobs=None if seq.logprobs is None else list(seq.logprobs),
                    delta_logprobs=None if seq.logprobs is None else seq.logprobs[sent_tokens:],
                )
            )
            state.emitted[seq.index] = (len(token_ids), visible)
        return self._request_output(state, outs, state.finished)

    def failure(self, state: RequestState, error: RequestError) -> RequestOutput:
        empty = [CompletionOutput(index=0, token_ids=[], text="", finish_reason="error")]
        return self._request_output(state, empty, True, error)

    def _request_output(
        self,
        state: RequestState,
        outs: list[CompletionOutput],
        finished: bool,
        error: RequestError | None = None,
    ) -> RequestOutput:
        first = state.seqs[0]
        media = _media(state.images)
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            visual_tokens=[sum(i.length for i in spans) for spans in media],
            visual_levels=[
                spans[0].video.level if spans[0].video else self.level_of(spans[0].max_pixels)
                for spans in media
            ],
            video_tokens=sum(i.length for i in state.images if i.video is not None),
            metrics={
                "arrival_time": first.arrival_time,
                "first_token_time": first.first_token_time,
                "num_preemptions": sum(s.num_preemptions for s in state.seqs),
            },
            error=error,
        )


def _media(items: list[ImageItem]) -> list[list[ImageItem]]:
    """The prompt's images and videos, each as its placeholder spans (a Qwen3-VL video has one per temporal
    patch, all of one key, the later ones with rows_from > 0)."""
    out: list[list[ImageItem]] = []
    for item in items:
        if item.rows_from and out and out[-1][0].key == item.key:
            out[-1].append(item)
        else:
            out.append([item])
    return out
