"""The engine loop: admit requests, schedule a step, run it, sample, detokenize, finish."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache import EmbeddingCache
from encoder import VisionPipeline, vision_fingerprint
from lm_engine.block_manager import BlockManager
from lm_engine.config import EngineConfig
from lm_engine.detokenizer import detokenize_step, flush
from lm_engine.device import is_fatal_device_error, to_device
from lm_engine.model_runner import ModelRunner
from lm_engine.models.qwen2_vl import Qwen2VLConfig
from lm_engine.outputs import CompletionOutput, RequestOutput
from lm_engine.processor import InputError, InputProcessor, PromptInputs
from lm_engine.sampler import sample
from lm_engine.sampling_params import SamplingParams
from lm_engine.scheduler import Scheduler
from lm_engine.sequence import Sequence, SequenceStatus
from lm_engine.visual_budget import (
    BudgetSignals,
    PrefillRate,
    TTFTWindow,
    VisualBudgetController,
    default_ladder,
)
from preprocess import PreprocessConfig, PreprocessError, PreprocessPool, PreprocessWorkerError

log = logging.getLogger("vlmserve.engine")


def queue_refusal(
    config: EngineConfig, queued_requests: int, queued_tokens: int, new_tokens: int = 0
) -> str | None:
    """Why the bounded queue refuses a request of ``new_tokens`` prompt tokens, or None if it has room."""
    if config.max_queued_requests is not None and queued_requests >= config.max_queued_requests:
        return f"{queued_requests} requests are already queued"
    if config.max_queued_tokens is not None and queued_tokens + new_tokens > config.max_queued_tokens:
        return "the queue of prompt tokens is full"
    return None


class EngineOverloaded(RuntimeError):
    """New work refused by admission control (a 503 with Retry-After to an HTTP client)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, frozen=True)
class AdmissionState:
    """Admission control's view of new work, published by the engine after each controller update.

    NOTE: other threads (the API's event loop) read ``LLMEngine.admission`` without a lock. That is safe:
    the engine thread only ever replaces the whole immutable snapshot with one attribute store, and a
    reference load or store is atomic in CPython (with or without the GIL), so a reader sees one update's
    state or the next one's, never a mix. It can be one engine step old; a refusal or an admission
    decided on it is no less right than one decided a step earlier.
    """

    overloaded: bool = False  # even the lowest visual budget cannot serve the queue within the TTFT SLO
    retry_after_s: float = 1.0  # the expected time to drain what is queued (≥ 1 s)
    reason: str | None = None  # why new work is refused, when overloaded
    expected_wait_s: float | None = None  # of the queued prefill work, None until throughput is measured


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    prompt: PromptInputs
    seqs: list[Sequence]
    emitted: dict[int, tuple[int, int]] = field(default_factory=dict)  # index → (tokens, chars) sent
    forked: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = Path(config.model)
        self.model_config = Qwen2VLConfig.from_dir(path)
        self.dtype = config.resolve_dtype(self.model_config.dtype)
        if config.dtype == "auto" and self.dtype != self.model_config.dtype:
            log.info(
                "computing in %s on %s, not the checkpoint's %s (dtype=auto; pass --dtype to force)",
                str(self.dtype).removeprefix("torch."),
                config.device,
                str(self.model_config.dtype).removeprefix("torch."),
            )
        self.max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, 8192)
        self.preprocess_config = PreprocessConfig.from_checkpoint(path)
        self.processor = InputProcessor(path, self.model_config, self.preprocess_config)
        self.runner = ModelRunner(
            path,
            self.model_config,
            dtype=self.dtype,
            device=config.device,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory,
            memory_utilization=config.memory_utilization,
            attention_backend=config.attention_backend,
            warmup_image_patches=config.warmup_image_patches,
        )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        # NOTE: a sequence must always fit the pool on its own, or preemption could never make room for it.
        pool_tokens = self.runner.num_blocks * config.block_size
        if self.max_model_len > pool_tokens:
            log.warning(
                "max_model_len %d exceeds the KV pool (%d tokens); capping it",
                self.max_model_len,
                pool_tokens,
            )
            self.max_model_len = pool_tokens
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, ready=self._images_ready
        )
        self.processor.model_fingerprint = vision_fingerprint(self.runner.vision)
        self.embedding_cache = EmbeddingCache.create(
            config.embedding_cache_bytes, config.redis_url, prefix=config.redis_key_prefix
        )
        self.preprocess_pool = (
            PreprocessPool(config.preprocess_workers) if config.preprocess_workers > 0 else None
        )
        self.vision = VisionPipeline(
            self.runner.encode_images,
            self.preprocess_config,
            merge_size=self.model_config.spatial_merge_size,
            cache=self.embedding_cache,
            pool=self.preprocess_pool,
            max_batch_patches=config.encoder_max_batch_patches,
            max_wait_s=config.encoder_max_wait_ms / 1000,
            is_fatal=is_fatal_device_error,
        )
        self._failed: list[Sequence] = []
        pp = self.preprocess_config
        self.visual_budget = VisualBudgetController(
            ladder=list(config.visual_ladder or default_ladder(pp.max_pixels, pp.min_pixels)),
            ttft_slo_s=config.ttft_slo_ms / 1000,
            dwell_s=config.budget_dwell_s,
            enabled=config.visual_budget == "adaptive",
        )
        self.ttft_window = TTFTWindow(window_s=5 * config.budget_dwell_s)
        self.prefill_rate = PrefillRate(horizon_s=5 * config.budget_dwell_s)
        self.admission = AdmissionState()
        self.num_rejected = 0
        self.requests: dict[str, RequestState] = {}
        self.eos_ids = set(self.model_config.eos_token_ids)
        self.step_count = 0

    # -- requests ------------------------------------------------------------------------------------------
    def process_chat(self, messages: list[dict]) -> PromptInputs:
        """Messages → prompt; each image's grid is planned at the visual budget level of this moment."""
        return self.processor.process_chat(messages, budget=self.visual_budget.max_pixels)

    def check_admission(self, num_tokens: int = 0) -> None:
        """Raise EngineOverloaded when new work could not be served in time (never drops admitted work).

        The server decides this on its event loop instead (api/async_engine.py), from ``self.admission``
        and its own queue counts, so that a refusal never waits for a step to end."""
        sched = self.scheduler
        state = self.admission
        reason = state.reason if state.overloaded else None
        reason = reason or queue_refusal(self.config, len(sched.waiting), sched.waiting_tokens(), num_tokens)
        if reason is not None:
            self.num_rejected += 1
            raise EngineOverloaded(f"overloaded: {reason}; retry shortly", retry_after_s=state.retry_after_s)

    def _queued_prefill_tokens(self) -> int:
        """Prompt tokens (visual included) still to prefill: the work ahead of a new request."""
        running = sum(s.num_uncomputed for s in self.scheduler.running if s.num_uncomputed > 1)
        return self.scheduler.waiting_tokens() + running

    def _retry_after(self, queued_tokens: int) -> float:
        """Whole seconds until what is queued now has been prefilled, at the measured throughput."""
        rate = self.prefill_rate.tokens_per_s
        if rate is None:  # nothing measured yet: a rough 50 ms per full step
            wait = queued_tokens / max(1, self.config.max_num_batched_tokens) * 0.05
        else:
            wait = queued_tokens / rate
        return float(max(1, min(60, math.ceil(wait))))

    def add_request(
        self,
        request_id: str,
        prompt: PromptInputs | list[dict],
        params: SamplingParams,
        client_key: str = "",
        *,
        admission: bool = True,
    ) -> None:
        """Queue a request. ``admission=False``: the caller already applied admission control (the server
        does, before the request reaches the engine thread)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not isinstance(prompt, PromptInputs):
            prompt = self.process_chat(prompt)
        n_prompt = len(prompt.token_ids)
        if admission:
            self.check_admission(n_prompt)
        if n_prompt >= self.max_model_len:
            raise InputError(
                f"prompt is {n_prompt} tokens; this model's context is {self.max_model_len} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        if not self.block_manager.fits_at_all(n_prompt + 1):
            raise InputError(
                f"prompt is {n_prompt} tokens; the KV cache holds {self.block_manager.num_blocks} blocks of "
                f"{self.config.block_size} tokens, too few for it",
                param="messages",
                code="context_length_exceeded",
            )
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt.token_ids),
            num_prompt_tokens=n_prompt,
            params=params,
            images=prompt.images,
            positions=prompt.positions,
            position_delta=prompt.position_delta,
            client_key=client_key,
        )
        if params.seed is not None:
            seq.generator = self._generator(params.seed)
        self.requests[request_id] = RequestState(request_id, params, prompt, [seq])
        self.scheduler.add(seq)

    def _generator(self, seed: int) -> torch.Generator:
        """A seeded request's own generator, on the device its logits are sampled on."""
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        if not self.requests:
            self._update_visual_budget()  # idle from here on (no step follows)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step, with the visual budget controller fed the state before it and the state it left."""
        queued, t0 = self._update_visual_budget(), time.monotonic()
        self.scheduler.prefill_cap_with_decodes = self._prefill_cap()
        outputs = self._step()
        if queued >= self.config.max_num_batched_tokens:  # a step that could fill its budget
            # NOTE: no request is added during a step, so the queue's shrinkage is the prefill it did (prefix
            # cache hits included); a step that only waited for the encoder counts with 0 tokens.
            self.prefill_rate.observe(queued - self._queued_prefill_tokens(), time.monotonic() - t0)
        self._update_visual_budget()  # the engine may be idle from here on: the controller must know
        return outputs

    def _prefill_cap(self) -> int | None:
        """Prefill tokens that fit the per-token target beside decodes, at the measured prefill rate.

        The rate is measured on such capped steps too, so the cap settles where a step's fixed cost plus its
        prefill fills the target (at least one block, so prefill always moves)."""
        slo, rate = self.config.tpot_slo_ms, self.prefill_rate.tokens_per_s
        if slo is None or rate is None:
            return None
        return max(self.config.block_size, int(rate * slo / 1000 * 0.8))

    def _step(self) -> list[RequestOutput]:
        if self.vision.fatal is not None:
            raise self.vision.fatal  # the device is unusable: every request would fail on it
        sched = self.scheduler.schedule()
        failed = self._fail_broken_images()
        if sched.is_empty:
            if not failed and self.vision.pending:
                self.vision.wait(0.05)  # nothing runnable until an image is encoded
            return failed
        self.step_count += 1
        completing, logits = self.runner.execute(sched)
        touched: dict[str, RequestState] = {}
        for chunk in sched.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)
        rows, seqs = [], []
        for i, chunk in enumerate(completing):
            seq = chunk.seq
            state = self.requests[seq.request_id]
            touched[seq.request_id] = state
            if state.params.n > 1 and not state.forked:
                state.forked = True
                for index in range(1, state.params.n):
                    child = seq.fork(index)
                    if state.params.seed is not None:
                        child.generator = self._generator(state.params.seed + index)
                    self.block_manager.fork(seq, child)
                    self.scheduler.running.append(child)
                    state.seqs.append(child)
                    rows.append(i)
                    seqs.append(child)
            rows.append(i)
            seqs.append(seq)
        if seqs:
            if rows != list(range(len(completing))):  # forked choices sample from their parent's row
                logits = logits.index_select(0, to_device(torch.tensor(rows), logits.device))
            tokens = sample(logits, seqs)
            now = time.monotonic()
            for seq, tok in zip(seqs, tokens):
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    if seq.index == 0:
                        self.ttft_window.add(now - seq.arrival_time)
                seq.token_ids.append(tok)
                self._check_stop(seq, tok)
        for seq in sched.preempted:
            touched.setdefault(seq.request_id, self.requests[seq.request_id])
        return failed + [out for state in touched.values() if (out := self._make_output(state)) is not None]

    def _update_visual_budget(self) -> int:
        """Feed the controller and publish the admission state; returns the queued prefill tokens."""
        queued = self._queued_prefill_tokens()
        vb = self.visual_budget
        vb.update(
            BudgetSignals(
                queued_tokens=queued,
                token_budget=self.config.max_num_batched_tokens,
                kv_usage=self.block_manager.usage(),
                recent_ttft_s=self.ttft_window.percentile(0.9),
                prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
                busy=bool(self.requests),
            )
        )
        wait = vb.expected_wait_s
        reason = None
        if vb.saturated:
            reason = (
                f"even the lowest visual budget leaves {wait:.1f} s of queued work, over the "
                f"{vb.ttft_slo_s:.1f} s time-to-first-token target"
            )
        self.admission = AdmissionState(vb.saturated, self._retry_after(queued), reason, wait)
        return queued

    def _images_ready(self, seq: Sequence) -> bool:
        """Admission gate: the images overlapping what the prefix cache cannot serve must be encoded."""
        if not seq.images:
            return True
        cached = self.block_manager.cached_prefix_tokens(seq)
        need = [im for im in seq.images if im.embedding is None and im.offset + im.length > cached]
        if any(im.error is not None for im in need):
            self._failed.append(seq)
            return False
        if need:
            self.vision.request(need)
            return False
        return True

    def _fail_broken_images(self) -> list[RequestOutput]:
        outs = []
        for seq in self._failed:
            state = self.requests.pop(seq.request_id, None)
            if state is None:
                continue
            err = next(im.error for im in seq.images if im.error is not None)
            index = next(i for i, im in enumerate(seq.images) if im.error is not None)
            for s in state.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s)
                    s.finish_reason = "error"
            if isinstance(err, (PreprocessError, PreprocessWorkerError)):  # the image's own fault
                status, code, message = (
                    400,
                    getattr(err, "code", "invalid_image"),
                    getattr(err, "message", str(err)),
                )
            else:  # the encoder failed on a good image: the server's fault
                status, code, message = (
                    500,
                    "encoder_error",
                    f"the vision encoder failed: {type(err).__name__}",
                )
            outs.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt_token_ids=state.prompt.token_ids,
                    outputs=[CompletionOutput(index=0, token_ids=[], text="", finish_reason="error")],
                    finished=True,
                    error={
                        "message": f"image {index}: {message}",
                        "code": code,
                        "param": "image_url",
                        "status": status,
                    },
                )
            )
        self._failed.clear()
        return outs

    def close(self) -> None:
        self.vision.close()
        if self.preprocess_pool is not None:
            self.preprocess_pool.close()
        self.embedding_cache.close()

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        detokenize_step(seq, self.processor.decode)
        reason, stop_reason = None, None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
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
        if reason is not None:
            if stop_reason is None or isinstance(stop_reason, int):
                flush(seq, self.processor.decode)
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
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
                )
            )
            state.emitted[seq.index] = (len(token_ids), visible)
        finished = len(state.seqs) == state.params.n and all(s.is_finished for s in state.seqs)
        first = state.seqs[0]
        if finished:
            self.requests.pop(state.request_id, None)
        metrics = {
            "arrival_time": first.arrival_time,
            "first_token_time": first.first_token_time,
            "num_preemptions": sum(s.num_preemptions for s in state.seqs),
        }
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt.token_ids,
            outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            visual_tokens=[i.length for i in state.prompt.images],
            visual_levels=[self._level_of(i.max_pixels) for i in state.prompt.images],
            metrics=metrics,
        )

    def _level_of(self, max_pixels: int | None) -> int:
        ladder = self.visual_budget.ladder
        return ladder.index(max_pixels) if max_pixels in ladder else 0

    # -- introspection -------------------------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        return [s for st in self.requests.values() for s in st.seqs if s.status is SequenceStatus.RUNNING]

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.running)
        running_ids = {s.seq_id for s in self.scheduler.running}
        for seq in self.scheduler.waiting:
            assert not seq.block_table and seq.seq_id not in running_ids
