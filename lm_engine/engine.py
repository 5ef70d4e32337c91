"""The engine loop: admit requests, schedule a step, run it, sample, detokenize, finish."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cache import EmbeddingCache
from encoder import VisionPipeline, vision_fingerprint
from lm_engine.admission import Admission, EngineOverloaded, Ticket
from lm_engine.block_manager import BlockManager
from lm_engine.config import EngineConfig
from lm_engine.device import is_fatal_device_error, to_device
from lm_engine.images import EncodedImages
from lm_engine.load import LoadControl
from lm_engine.model_runner import ModelRunner
from lm_engine.models.registry import ModelConfig, load_model_config
from lm_engine.output_processor import OutputProcessor, RequestState
from lm_engine.outputs import RequestError, RequestOutput, TokenLogprob
from lm_engine.processor import ChatInput, InputError, InputProcessor, PromptInputs
from lm_engine.sampler import sample, token_logprobs
from lm_engine.sampling_params import SamplingParams
from lm_engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from lm_engine.sequence import ImageItem, Sequence, SequenceStatus
from lm_engine.visual_budget import default_ladder
from preprocess import PreprocessConfig, PreprocessError, PreprocessPool, PreprocessWorkerError

log = logging.getLogger("vlmserve.engine")

__all__ = ["EngineOverloaded", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what arrival, first-token and step times are read from (and what the load controller's
        dwell and measured rates are in); tests pass a clock they advance themselves."""
        self.config = config
        self.clock = clock
        path = Path(config.model)
        self.model_config = load_model_config(path)
        self.dtype = _compute_dtype(config, self.model_config)
        self.preprocess_config = PreprocessConfig.from_checkpoint(path)
        self.processor = InputProcessor(path, self.model_config, self.preprocess_config)
        max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, 8192)
        self.runner = ModelRunner(path, self.model_config, config, self.dtype, max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        # NOTE: a sequence must always fit the pool on its own, or preemption could never make room for it.
        pool_tokens = self.runner.num_blocks * config.block_size
        if max_model_len > pool_tokens:
            log.warning(
                "max_model_len %d exceeds the KV pool (%d tokens); capping it", max_model_len, pool_tokens
            )
        self.max_model_len = self.processor.max_prompt_tokens = min(max_model_len, pool_tokens)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.admission = Admission(config.max_queued_requests, config.max_queued_tokens)
        pp = self.preprocess_config
        ladder = list(config.visual_ladder or default_ladder(pp.max_pixels, pp.min_pixels, pp.factor))
        self.load = LoadControl(config, ladder, self.scheduler, self.block_manager, self.admission, clock)
        self.processor.model_fingerprint = vision_fingerprint(self.runner.vision)
        self.embedding_cache = EmbeddingCache.create(
            config.embedding_cache_bytes, config.redis_url, prefix=config.redis_key_prefix
        )
        workers = config.preprocess_workers
        self.preprocess_pool = PreprocessPool(workers) if workers > 0 else None
        self.vision = VisionPipeline(
            self.runner.encode_images,
            pp,
            merge_size=self.model_config.spatial_merge_size,
            cache=self.embedding_cache,
            pool=self.preprocess_pool,
            max_batch_patches=config.encoder_max_batch_patches,
            max_wait_s=config.encoder_max_wait_ms / 1000,
            is_fatal=is_fatal_device_error,
            row_width=self.runner.vision.out_dim * (1 + self.runner.vision.levels),
            dtype=self.runner.dtype,
        )
        if config.encoder_url or config.encoder_workers:
            from encoder.tier.client import connect

            self.vision = connect(config, self.vision, self.embedding_cache, self.processor.model_fingerprint)
        self.images = EncodedImages(self.vision, self.runner.place)
        eos = set(self.model_config.eos_token_ids)
        self.outputs = OutputProcessor(self.processor.decode, eos, self.max_model_len, self.load.level_of)
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0

    # -- requests ------------------------------------------------------------------------------------------
    def process_chat(self, messages: list[dict] | ChatInput) -> PromptInputs:
        """Messages → prompt; each image's grid is planned at the visual budget level of this moment."""
        return self.processor.process_chat(messages, budget=self.load.visual_budget.max_pixels)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInputs | list[dict],
        params: SamplingParams,
        client_key: str = "",
        ticket: Ticket | None = None,
    ) -> None:
        """Queue a request. Admission control decides here unless the caller already did and passes the
        ``ticket`` it got (the server does, on its event loop, before the request reaches the engine thread)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not isinstance(prompt, PromptInputs):
            prompt = self.process_chat(prompt)
        n_prompt = len(prompt.token_ids)
        self._check_fits(n_prompt)
        ticket = ticket or self.admission.admit(n_prompt, client_key)
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt.token_ids),
            num_prompt_tokens=n_prompt,
            params=params,
            images=prompt.images,
            positions=prompt.positions,
            position_delta=prompt.position_delta,
            client_key=client_key,
            arrival_time=self.clock(),
            status=SequenceStatus.WAITING_FOR_IMAGES if prompt.images else SequenceStatus.WAITING,
        )
        if params.seed is not None:
            seq.generator = self._generator(params.seed)
        state = RequestState(
            request_id, params, [seq], prompt.token_ids, prompt.images, dict(prompt.image_data), ticket=ticket
        )
        self.images.hold(prompt.images)
        self.requests[request_id] = state
        self.scheduler.add(seq)

    def _check_fits(self, n_prompt: int) -> None:
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

    def _generator(self, seed: int) -> torch.Generator:
        """A seeded request's own generator, on the device its logits are sampled on."""
        return torch.Generator(device=self.runner.device).manual_seed(seed)

    def abort(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._finish_all(state, "abort")
        if not self.requests:
            self.load.update(busy=False)  # idle from here on (no step follows)
        return True

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size: allocated (and touched) at start-up, fixed for the engine's life."""
        return self.runner.kv_cache.nbytes

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step, with load control fed the state before it and the state it left."""
        if self.vision.fatal is not None:
            raise self.vision.fatal  # the device is unusable: every request would fail on it
        self.load.before_step(busy=bool(self.requests))
        outputs = self._settle_images()
        sched = self.scheduler.schedule()
        if sched.chunks:
            outputs += self._run(sched)
        elif not outputs:
            self.images.wait(0.05)  # nothing runnable until an image is encoded
        self.load.after_step(busy=bool(self.requests))
        return outputs

    def _settle_images(self) -> list[RequestOutput]:
        """Sequences waiting for images become schedulable once every image past their cached prefix is
        encoded; the missing ones go to the encoder; a request whose image failed ends with its error."""
        self.images.collect()
        failed = []
        for seq in [s for s in self.scheduler.waiting if s.status is SequenceStatus.WAITING_FOR_IMAGES]:
            state = self.requests[seq.request_id]
            cached = self.block_manager.cached_prefix_tokens(seq)
            needed = [im for im in seq.images if im.end > cached]
            broken = next((im for im in needed if im.key in self.images.failed), None)
            if broken is not None:
                failed.append(self._fail(state, broken))
            elif missing := self.images.missing(needed):
                self.images.request(missing, state.image_data)
            else:
                seq.status, seq.images_ready_after = SequenceStatus.WAITING, cached
        return failed

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        self.step_count += 1
        completing, logits = self.runner.execute(sched, self.images.ready)
        for chunk in sched.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)
            self.requests[chunk.seq.request_id].ticket.release()  # scheduled: out of the admission queue
        seqs, rows = self._fork_choices(completing)
        touched = {s.request_id for s in sched.preempted}
        if seqs:
            if rows != list(range(len(completing))):  # forked choices sample from their parent's row
                logits = logits.index_select(0, to_device(torch.tensor(rows), logits.device))
            now = self.clock()
            tokens = sample(logits, seqs, self.outputs.eos_ids)
            if any(s.params.logprobs is not None for s in seqs):
                self._record_logprobs(seqs, token_logprobs(logits, seqs, tokens), tokens)
            for seq, tok in zip(seqs, tokens):
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    if seq.index == 0:
                        self.load.first_token(now - seq.arrival_time)
                if self.outputs.append(seq, tok):
                    self.scheduler.finish(seq)
                touched.add(seq.request_id)
        return [self._output(self.requests[rid]) for rid in touched]

    def _record_logprobs(self, seqs: list[Sequence], entries: list, tokens: list[int]) -> None:
        texts: dict[int, str] = {}  # a token is usually among its own top alternatives, and rows share them

        def text(tok: int) -> str:
            if tok not in texts:
                texts[tok] = self.processor.decode([tok], skip_special_tokens=False)
            return texts[tok]

        for seq, entry, tok in zip(seqs, entries, tokens):
            if entry is None:
                continue
            chosen, top = entry
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(
                TokenLogprob(tok, text(tok), chosen, tuple((t, text(t), lp) for t, lp in top))
            )

    def _fork_choices(self, completing: list[ScheduledChunk]) -> tuple[list[Sequence], list[int]]:
        """The sequences to sample, each with its logits row. The first time a request with n > 1 completes
        its prompt, its other choices fork from it: they share its blocks and sample from its row."""
        seqs, rows = [], []
        for row, chunk in enumerate(completing):
            seq = chunk.seq
            state = self.requests[seq.request_id]
            if state.params.n > 1 and not state.forked:
                state.forked = True
                for index in range(1, state.params.n):
                    child = seq.fork(index)
                    if state.params.seed is not None:
                        child.generator = self._generator(state.params.seed + index)
                    self.block_manager.fork(seq, child)
                    self.scheduler.running.append(child)
                    state.seqs.append(child)
                    seqs.append(child)
                    rows.append(row)
            seqs.append(seq)
            rows.append(row)
        return seqs, rows

    def _output(self, state: RequestState) -> RequestOutput:
        out = self.outputs.output(state)
        if out.finished:
            self._end(state)
        return out

    def _fail(self, state: RequestState, image: ImageItem) -> RequestOutput:
        error = _image_error(self.images.failed[image.key], state.images.index(image))
        self._finish_all(state, "error")
        return self.outputs.failure(state, error)

    def _finish_all(self, state: RequestState, reason: str) -> None:
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = reason
        self._end(state)

    def _end(self, state: RequestState) -> None:
        """Everything the request held goes back: its images' embeddings, its admission ticket."""
        if self.requests.pop(state.request_id, None) is not None:
            self.images.release(state.images)
            state.ticket.release()
            state.image_data.clear()

    def close(self) -> None:
        self.vision.close()
        if self.preprocess_pool is not None:
            self.preprocess_pool.close()
        self.embedding_cache.close()

    # -- introspection -------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.running)
        running_ids = {s.seq_id for s in self.scheduler.running}
        for seq in self.scheduler.waiting:
            assert not seq.block_table and seq.seq_id not in running_ids
        held = {im.key for st in self.requests.values() for im in st.images}
        assert set(self.images.ready) <= held and set(self.images.failed) <= held


def _compute_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    dtype = config.resolve_dtype(model_config.dtype)
    if config.dtype == "auto" and dtype != model_config.dtype:
        log.info(
            "computing in %s on %s, not the checkpoint's %s (dtype=auto; pass --dtype to force)",
            str(dtype).removeprefix("torch."),
            config.device,
            str(model_config.dtype).removeprefix("torch."),
        )
    return dtype


def _image_error(err: BaseException, index: int) -> RequestError:
    """A bad image is the client's fault (400); the encoder failing on a good one is ours (500)."""
    if isinstance(err, (PreprocessError, PreprocessWorkerError)):
        message = getattr(err, "message", str(err))
        return RequestError(
            400, f"image {index}: {message}", getattr(err, "code", "invalid_image"), "image_url"
        )
    if (retry := getattr(err, "retry_after_s", None)) is not None:  # encoder tier unavailable
        return RequestError(503, f"image {index}: {err}", "encoder_unavailable", "image_url", retry)
    message = f"image {index}: the vision encoder failed: {type(err).__name__}"
    return RequestError(500, message, "encoder_error", "image_url")
