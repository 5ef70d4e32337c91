"""The engine loop: admit requests, schedule a step, run it, sample, detokenize, finish."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cache import EmbeddingCache
from encoder import EncoderClient, VisionPipeline, vision_fingerprint
from encoder.models import family_of, read_config
from lm_engine.admission import Admission, EngineOverloaded, Ticket
from lm_engine.block_manager import BlockManager
from lm_engine.config import EngineConfig
from lm_engine.device import is_fatal_device_error, to_device
from lm_engine.images import EncodedImages
from lm_engine.load import LoadControl
from lm_engine.memory import (
    MemoryPlan,
    check_fit,
    checkpoint_weight_bytes,
    kv_bytes_per_token,
    runtime_reserve_bytes,
)
from lm_engine.model_runner import ModelRunner
from lm_engine.models.registry import ModelConfig, load_model_config
from lm_engine.output_processor import OutputProcessor, RequestState
from lm_engine.outputs import RequestError, RequestOutput, TokenLogprob
from lm_engine.processor import ChatInput, InputError, InputProcessor, PromptInputs
from lm_engine.sampler import sample, token_logprobs
from lm_engine.sampling_params import SamplingParams
from lm_engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from lm_engine.sequence import ImageItem, Sequence, SequenceStatus
from lm_engine.startup import StartupPhases
from lm_engine.structured import GrammarError, GrammarMasks, Grammars, GrammarState
from lm_engine.visual_budget import default_ladder, video_budget
from preprocess import PreprocessConfig, PreprocessError, PreprocessPool, PreprocessWorkerError
from preprocess.video import VideoConfig
from runtime.memory import available_memory_bytes, format_bytes

log = logging.getLogger("vlmserve.engine")

__all__ = ["EngineOverloaded", "LLMEngine"]

_ASSUMED_AVAILABLE = 8 << 30  # where the system does not say (no /proc/meminfo)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        startup: StartupPhases | None = None,
    ) -> None:
        """``clock``: what arrival, first-token and step times are read from (and what the load controller's
        dwell and measured rates are in); tests pass a clock they advance themselves. ``startup``: the phases
        timed so far (the server's imports), to which the engine's own are added."""
        phases = startup or StartupPhases()
        # NOTE: before any weight is read: the KV pool is a share of this, less what the weights take.
        available = available_memory_bytes()
        self.config = config
        self.clock = clock
        path = Path(config.model)
        self.model_config = load_model_config(path)
        self.dtype = _compute_dtype(config, self.model_config)
        self.preprocess_config = PreprocessConfig.from_checkpoint(path)
        self.processor = InputProcessor(
            path,
            self.model_config,
            self.preprocess_config,
            config.hash_algorithm,
            _video_config(path, config),
        )
        max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, 8192)
        plan = _plan_memory(config, self.model_config, self.dtype, max_model_len, available)
        phases.lap("config")
        self.runner = ModelRunner(path, self.model_config, config, self.dtype, max_model_len, plan, phases)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            hash_algorithm=config.hash_algorithm,
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
        phases.lap("kv")
        self.embedding_cache = EmbeddingCache.create(
            config.embedding_cache_bytes, config.redis_url, prefix=config.redis_key_prefix
        )
        workers = config.preprocess_workers
        self.preprocess_pool = PreprocessPool(workers) if workers > 0 else None
        self.vision: EncoderClient
        self.vision = local = VisionPipeline(
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
        phases.lap("pools")
        if config.encoder_url or config.encoder_workers:
            from encoder.tier.client import connect

            self.vision = connect(config, self.vision, self.embedding_cache, self.processor.model_fingerprint)
            phases.lap("encoder")
        # NOTE: the layout the local pipeline checks cache entries against, whichever pipeline delivers.
        self.images = EncodedImages(self.vision, self.runner.place, local.layout)
        eos = set(self.model_config.eos_token_ids)
        self.outputs = OutputProcessor(self.processor.decode, eos, self.max_model_len, self.load.level_of)
        self.grammars = Grammars(self.processor.tokenizer, self.model_config.vocab_size, sorted(eos))
        self.masks = GrammarMasks(self.grammars.width)
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0
        self.startup_phases = dict(phases.phases)  # phase → seconds; they add up to the whole start
        log.info("%s", phases.line())

    # -- requests ------------------------------------------------------------------------------------------
    def process_chat(self, messages: list[dict] | ChatInput, cache_salt: str = "") -> PromptInputs:
        """Messages → prompt; each image's grid is planned at the visual budget level of this moment. A salted
        prompt's images are keyed with its ``cache_salt`` (pass the same salt to add_request)."""
        return self.processor.process_chat(
            messages,
            budget=self.load.visual_budget.max_pixels,
            cache_salt=cache_salt,
            video_budget=functools.partial(video_budget, self.load.visual_budget),
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptInputs | list[dict],
        params: SamplingParams,
        client_key: str = "",
        ticket: Ticket | None = None,
        cache_salt: str = "",
    ) -> None:
        """Queue a request. Admission control decides here unless the caller already did and passes the
        ``ticket`` it got (the server does, on its event loop, before the request reaches the engine thread)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not isinstance(prompt, PromptInputs):
            prompt = self.process_chat(prompt, cache_salt)
        if any(im.key.cache_salt != cache_salt for im in prompt.images):
            raise ValueError(
                "the prompt's images are keyed with another cache_salt: give process_chat the same"
            )
        n_prompt = len(prompt.token_ids)
        self._check_fits(n_prompt)
        grammar = self._grammar(params)
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
            cache_salt=cache_salt,
            arrival_time=self.clock(),
            status=SequenceStatus.WAITING_FOR_IMAGES if prompt.images else SequenceStatus.WAITING,
        )
        if params.seed is not None:
            seq.generator = self._generator(params.seed)
        if grammar is not None:
            seq.grammar = GrammarState(grammar.matcher(), params.grammar_after)
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

    def _grammar(self, params: SamplingParams):
        """The request's compiled grammar (None: unconstrained). A cache hit where the caller compiled it
        already, on its own thread (``self.grammars.compile``), as the server does."""
        if params.grammar is None:
            return None
        try:
            return self.grammars.compile(params.grammar)
        except GrammarError as exc:
            raise InputError(
                f"the grammar cannot be compiled: {exc}", param="grammar", code="invalid_grammar"
            ) from None

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
        """One forward pass and its sampling. A failure that one request's inputs cause (its parameters, its
        embeddings) ends that request alone, with an error of its own; the others go on as if it had not
        been in the step. A failure no single request explains is the engine's and is raised."""
        self.step_count += 1
        faults: dict[str, BaseException] = {}
        # NOTE: the masks of the constrained rows compute on a worker thread while the forward pass runs.
        masks = self.masks.start([c.seq.grammar for c in sched.chunks if c.completes and c.seq.grammar])
        completing, logits = self._execute(sched, faults)
        raw = logits  # what logprobs are read from: the model's own distribution, masks or not
        if masks is not None:
            if any(c.seq.grammar and c.seq.params.logprobs is not None for c in completing):
                raw = logits.clone()
            broken = masks.apply(logits, [c.seq.grammar for c in completing])
            for row in broken:
                faults[completing[row].seq.request_id] = GrammarError("the grammar allows no next token")
        for chunk in sched.chunks:
            if chunk.seq.request_id in faults:
                continue
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)
            self.requests[chunk.seq.request_id].ticket.release()  # scheduled: out of the admission queue
        seqs, rows = self._fork_choices(completing)
        touched = {s.request_id for s in sched.preempted}
        if seqs:
            if rows != list(range(len(completing))):  # forked choices sample from their parent's row
                logits, raw = _rows(logits, raw, rows)
            now = self.clock()
            eos = self.outputs.eos_ids
            tokens = self._isolated(lambda j: sample(logits[j], seqs[j], eos), seqs, faults)
            live = [j for j, s in enumerate(seqs) if s.request_id not in faults]
            if len(live) < len(seqs):
                seqs, tokens = [seqs[j] for j in live], [tokens[j] for j in live]
                logits, raw = _rows(logits, raw, live)
            if any(s.params.logprobs is not None for s in seqs):
                entries = self._isolated(lambda j: token_logprobs(raw[j], seqs[j], tokens[j]), seqs, faults)
                self._record_logprobs(seqs, entries, tokens, faults)
            for seq, tok in zip(seqs, tokens):
                if seq.request_id in faults:
                    continue
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    if seq.index == 0:
                        self.load.first_token(now - seq.arrival_time)
                try:
                    if seq.grammar is not None and not seq.grammar.advance(tok):
                        raise GrammarError(
                            f"the grammar refused token {tok}: {seq.grammar.matcher.get_error()}"
                        )
                    if self.outputs.append(seq, tok) or self._grammar_done(seq):
                        self.scheduler.finish(seq)
                except Exception as exc:  # detokenizing, stop strings, its grammar: this request's own
                    _raise_if_engine_fault(exc)
                    faults[seq.request_id] = exc
                    continue
                touched.add(seq.request_id)
        failed = [self._fault(self.requests[rid], exc) for rid, exc in faults.items() if rid in self.requests]
        return failed + [self._output(self.requests[rid]) for rid in touched - faults.keys()]

    def _grammar_done(self, seq: Sequence) -> bool:
        """A sequence whose grammar is complete ends here ("stop"): the only token left to it is the end."""
        if seq.grammar is None:
            return False
        seq.grammar.notice(seq.output_text)
        if not seq.grammar.stopped:
            return False
        self.outputs.finish(seq, "stop")
        return True

    def _execute(
        self, sched: SchedulerOutput, faults: dict[str, BaseException]
    ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """The forward pass. If it fails, each chunk runs again on its own (re-writing its own KV slots, as
        the failed pass would have): those that fail alone are their requests' faults, recorded in ``faults``,
        and the rest are the step's result. If every chunk runs alone, or every request's fails alone too, the
        fault is the engine's and is raised."""
        try:
            return self.runner.execute(sched, self.images.ready)
        except Exception as exc:
            _raise_if_engine_fault(exc)
            error = exc
        log.warning("a step of %d chunk(s) failed (%r); running them one by one", len(sched.chunks), error)
        completing, parts = [], []
        for chunk in sched.chunks:
            if chunk.seq.request_id in faults:
                continue  # another choice of the same request failed
            try:
                # NOTE: no block copies: the failed pass made them before it built its inputs.
                done, logits = self.runner.execute(SchedulerOutput(chunks=[chunk]), self.images.ready)
            except Exception as exc:
                _raise_if_engine_fault(exc)
                faults[chunk.seq.request_id] = exc
                continue
            completing += done
            parts.append(logits)
        requests = {c.seq.request_id for c in sched.chunks}
        if not faults or (len(requests) > 1 and set(faults) == requests):
            raise error  # nothing runs alone, or everything fails alone: the engine's fault, not a request's
        keep = [i for i, c in enumerate(completing) if c.seq.request_id not in faults]
        logits = torch.cat(parts) if parts else torch.empty(0, self.model_config.vocab_size)
        if len(keep) != len(completing):
            logits = logits.index_select(0, to_device(torch.tensor(keep, dtype=torch.long), logits.device))
        return [completing[i] for i in keep], logits

    def _isolated(self, fn, seqs: list[Sequence], faults: dict[str, BaseException]) -> list:
        """``fn(rows)`` for a slice of ``seqs`` (one result per row) over all of them; if that fails, row by row,
        so a row that fails on its own is its request's fault (None in its place) and the other rows keep
        their results. If every row succeeds alone, or every request's row fails alone too, the failure is the
        engine's and is raised."""
        try:
            return fn(slice(None))
        except Exception as exc:
            _raise_if_engine_fault(exc)
            error = exc
        out: list = []
        for row, seq in enumerate(seqs):
            try:
                out += fn(slice(row, row + 1))
            except Exception as exc:
                _raise_if_engine_fault(exc)
                faults[seq.request_id] = exc
                out.append(None)
        failing = {seq.request_id for seq in seqs if seq.request_id in faults}
        if not failing or (len(failing) > 1 and failing == {seq.request_id for seq in seqs}):
            raise error  # nothing fails alone, or everything does: the engine's fault, not a request's
        return out

    def _fault(self, state: RequestState, exc: BaseException) -> RequestOutput:
        """End a request whose own inputs failed the step (the others in it went on)."""
        log.error("request %s failed in a step: %s: %s", state.request_id, type(exc).__name__, exc)
        self._finish_all(state, "error")
        error = RequestError(500, f"this request failed in the engine: {type(exc).__name__}", "engine_error")
        return self.outputs.failure(state, error)

    def _record_logprobs(
        self, seqs: list[Sequence], entries: list, tokens: list[int], faults: dict[str, BaseException]
    ) -> None:
        texts: dict[int, str] = {}  # a token is usually among its own top alternatives, and rows share them

        def text(tok: int) -> str:
            if tok not in texts:
                texts[tok] = self.processor.decode([tok], skip_special_tokens=False)
            return texts[tok]

        for seq, entry, tok in zip(seqs, entries, tokens):
            if entry is None or seq.request_id in faults:
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
        self.masks.close()
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


def _rows(logits: torch.Tensor, raw: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of the logits sampled from and of the unmasked ones logprobs read (often the same tensor)."""
    index = to_device(torch.tensor(rows, dtype=torch.long), logits.device)
    picked = logits.index_select(0, index)
    return picked, (picked if raw is logits else raw.index_select(0, index))


def _raise_if_engine_fault(exc: Exception) -> None:
    """Re-raise what no request's inputs can cause: the device is unusable, or memory ran out."""
    if is_fatal_device_error(exc) or isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        raise exc


def _plan_memory(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, max_model_len: int, available: int | None
) -> MemoryPlan | None:
    """What the KV pool is sized from on a CPU, once the checkpoint is known to fit (from its headers, before any
    weight is read; NotEnoughMemory where it does not). None on an accelerator: its own memory is measured there."""
    if not config.device.startswith("cpu"):
        return None
    if available is None:
        available = _ASSUMED_AVAILABLE
        log.warning("no /proc/meminfo: sizing memory as if %s were available", format_bytes(available))
    itemsize = torch.empty((), dtype=dtype).element_size()
    weights = checkpoint_weight_bytes(config.model, itemsize)
    reserve = runtime_reserve_bytes(
        config.embedding_cache_bytes, config.preprocess_workers, config.encoder_workers, weights.tower
    )
    per_token = kv_bytes_per_token(cfg, itemsize)
    blocks = (max_model_len + config.block_size - 1) // config.block_size + 1
    fixed, flag = config.kv_cache_memory, "--kv-cache-memory"
    if config.num_kv_blocks is not None:
        fixed, flag = config.num_kv_blocks * config.block_size * per_token, "--num-kv-blocks"
    check_fit(
        available=available,
        weight_bytes=weights.total,
        reserve=reserve,
        kv_bytes_per_token=per_token,
        max_model_len=max_model_len,
        min_kv_bytes=blocks * config.block_size * per_token,
        utilization=config.memory_utilization,
        fixed_kv=fixed,
        fixed_flag=flag,
    )
    log.info(
        "memory: %s available at start, weights %s (vision tower %s), runtime reserve %s",
        format_bytes(available),
        format_bytes(weights.total),
        format_bytes(weights.tower),
        format_bytes(reserve),
    )
    return MemoryPlan(available, weights.total, reserve)


def _video_config(path: Path, config: EngineConfig) -> VideoConfig:
    """The checkpoint's video processor settings with the server's limits."""
    family = family_of(read_config(path))
    limits = dict(
        max_sampled_frames=config.video_max_frames,
        max_duration_s=config.video_max_duration_s,
        max_frame_pixels=config.video_max_frame_pixels,
        max_visual_tokens=config.video_max_tokens,
    )
    if config.video_fps is not None:
        limits["fps"] = config.video_fps
    return VideoConfig.from_checkpoint(path, "qwen3" if family == "qwen3_vl" else "qwen2", **limits)


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
