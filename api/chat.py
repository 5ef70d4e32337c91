"""POST /v1/chat/completions: request → sampling params and prompt → engine → response or SSE stream."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from api.async_engine import AsyncEngine, EngineDead, EngineFailure, RequestStream
from api.config import ServerArgs
from api.errors import APIError, to_api_error
from api.media import MediaFetcher
from api.metrics import ServerMetrics
from api.output_parser import THINK_OPEN, OutputParser, message
from api.prompt import prepare_prompt
from api.protocol import ChatCompletionRequest
from api.structured import OutputPlan, compile_plan, output_plan
from lm_engine.outputs import RequestOutput, TokenLogprob
from lm_engine.sampling_params import SamplingParams

_MIN_TOP_P = 1e-6
VISUAL_LEVEL_HEADER = "X-Visual-Budget-Levels"


def _usage(out: RequestOutput) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    visual = sum(out.visual_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": out.num_cached_tokens,
            "image_tokens": visual - out.video_tokens,
            "video_tokens": out.video_tokens,
            "text_tokens": prompt - visual,
        },
        "visual_tokens": list(out.visual_tokens),
        "visual_levels": list(out.visual_levels),
    }


def logprobs_body(entries: list[TokenLogprob] | None) -> dict | None:
    """OpenAI's choice.logprobs: per token its text, log-probability, UTF-8 bytes and top alternatives."""
    if entries is None:
        return None

    def item(text: str, logprob: float) -> dict:
        # NOTE: a token holding part of a multi-byte character decodes to U+FFFD; its bytes say the same.
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(text, lp) for _, text, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


@dataclass(frozen=True, slots=True)
class Parsing:
    """How a request's output text is read: tool calls, a reasoning block (``thinking``: the prompt opened it)."""

    tools: bool = False
    reasoning: bool = False
    thinking: bool = False

    def parser(self) -> OutputParser | None:
        if not (self.tools or self.reasoning):
            return None  # NOTE: plain text stays byte for byte what the engine wrote
        return OutputParser(self.tools, self.reasoning, self.thinking)


def _finish_reason(reason: str | None, calls: bool) -> str | None:
    """OpenAI's "tool_calls" where a choice that stopped on its own ended with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def completion_body(out: RequestOutput, model: str, return_ids: bool, parsing: Parsing | None = None) -> dict:
    """The non-streamed chat.completion for a finished request (the server's answer and a batch line's)."""
    choices = []
    for c in out.outputs:
        parser = parsing.parser() if parsing else None
        msg = {"role": "assistant", "content": c.text} if parser is None else message(parser, c.text)
        choice = {
            "index": c.index,
            "message": msg,
            "finish_reason": _finish_reason(c.finish_reason, "tool_calls" in msg),
            "logprobs": logprobs_body(c.logprobs),
            "stop_reason": c.stop_reason,
        }
        if return_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    body = {
        "id": out.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(out),
    }
    if return_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    return body


def visual_level_header(levels: list[int]) -> dict[str, str]:
    """The visual budget level each image got (0 = full resolution), as a response header."""
    return {VISUAL_LEVEL_HEADER: ",".join(map(str, levels))} if levels else {}


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float | None = None

    def see(self, out: RequestOutput) -> None:
        if self.first_token is None and any(c.token_ids for c in out.outputs):
            self.first_token = time.monotonic()


async def _outputs(stream: RequestStream, timing: _Timing) -> AsyncIterator[RequestOutput]:
    """The request's outputs; a request the engine failed (e.g. an undecodable image) or an engine fault
    becomes an APIError."""
    try:
        async for out in stream:
            if out.error is not None:
                raise to_api_error(out.error)
            timing.see(out)
            yield out
    except (EngineFailure, EngineDead) as exc:
        raise to_api_error(exc) from None


class _ChunkWriter:
    """The chat.completion.chunk events of one streamed request."""

    def __init__(
        self, request_id: str, model: str, include_usage: bool, with_ids: bool, parsing: Parsing | None = None
    ) -> None:
        self.request_id, self.model = request_id, model
        self.include_usage, self.with_ids = include_usage, with_ids
        self.created = int(time.time())
        self.done: set[int] = set()  # choices whose finishing chunk went out
        self.parsing = parsing
        self.parsers: dict[int, OutputParser | None] = {}

    def chunk(self, choices: list[dict], usage: dict | None = None, **extra) -> str:
        body = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage:
            body["usage"] = usage
        return _sse(body)

    def first(self, n: int, prompt_ids: list[int] | None) -> str:
        """Every choice's role, before any content; the prompt's token ids when asked for."""
        delta = {"role": "assistant", "content": ""}
        first = [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None} for i in range(n)]
        if not self.with_ids:
            return self.chunk(first)
        return self.chunk([{**c, "token_ids": []} for c in first], prompt_token_ids=prompt_ids)

    def deltas(self, out: RequestOutput) -> str | None:
        """The choices that moved since the last output (or None: nothing to send)."""
        if self.parsing is not None and (self.parsing.tools or self.parsing.reasoning):
            return self._parsed_deltas(out)
        choices = []
        for c in out.outputs:
            finished = c.finish_reason is not None
            if c.index in self.done or not (c.delta_text or c.delta_token_ids or finished):
                continue
            choice = {
                "index": c.index,
                "delta": {"content": c.delta_text} if c.delta_text else {},
                "logprobs": logprobs_body(c.delta_logprobs) if c.delta_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            if finished:
                choice["stop_reason"] = c.stop_reason
                self.done.add(c.index)
            if self.with_ids:
                choice["token_ids"] = list(c.delta_token_ids)
            choices.append(choice)
        return self.chunk(choices) if choices else None

    def _parsed_deltas(self, out: RequestOutput) -> str | None:
        """As ``deltas``, the text read as content, reasoning and tool calls: one chunk per delta object (a
        chunk carries one delta per choice), the token ids and logprobs on a choice's first, its finish on its
        last."""
        events = []
        for c in out.outputs:
            finished = c.finish_reason is not None
            if c.index in self.done or not (c.delta_text or c.delta_token_ids or finished):
                continue
            parser = self.parsers.get(c.index)
            if parser is None:
                assert self.parsing is not None
                parser = self.parsers[c.index] = self.parsing.parser()
            parts = parser.feed(c.delta_text) + (parser.finish() if finished else [])
            if not parts and not finished and not self.with_ids and not c.delta_logprobs:
                continue  # held back (a tag may be starting): nothing to say yet
            choices = [
                {"index": c.index, "delta": part, "logprobs": None, "finish_reason": None}
                for part in parts or [{}]
            ]
            choices[0]["logprobs"] = logprobs_body(c.delta_logprobs) if c.delta_logprobs else None
            if self.with_ids:
                choices[0]["token_ids"] = list(c.delta_token_ids)
            if finished:
                choices[-1]["finish_reason"] = _finish_reason(c.finish_reason, parser.calls > 0)
                choices[-1]["stop_reason"] = c.stop_reason
                self.done.add(c.index)
            events += [self.chunk([choice]) for choice in choices]
        return "".join(events) or None


async def _prepend(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


class ChatService:
    def __init__(
        self,
        args: ServerArgs,
        engine: AsyncEngine,
        media: MediaFetcher,
        metrics: ServerMetrics,
        executor: Executor,
    ) -> None:
        self.args = args
        self.engine = engine
        self.media = media
        self.metrics = metrics
        self.executor = executor

    # -- validation ----------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        served = self.args.model_names
        if name is not None and name not in served:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name or served[0]

    def sampling_params(self, req: ChatCompletionRequest, plan: OutputPlan | None = None) -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        refused = req.unsupported()
        if refused is not None:
            param, message = refused
            raise APIError(400, message, param=param, code="unsupported")
        if plan is None:
            plan = output_plan(req)
        max_seqs = self.engine.engine.config.max_num_seqs
        if req.n > max_seqs:
            raise APIError(400, f"n must be at most {max_seqs} (--max-num-seqs)", param="n")
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                # NOTE: the sampler works in float32, where a top_p below ~1e-45 is 0 and drops every token;
                # any top_p under the top token's probability means "the top token", so clamping keeps the meaning.
                top_p=1.0 if req.top_p is None else max(req.top_p, _MIN_TOP_P),
                top_k=req.top_k or 0,
                # None: until a stop condition or the context length.
                max_tokens=req.max_completion_tokens or req.max_tokens,
                seed=req.seed,
                stop=req.stop or [],
                ignore_eos=req.ignore_eos,
                logit_bias=self._logit_bias(req.logit_bias),
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                min_tokens=req.min_tokens or 0,
                min_p=req.min_p or 0.0,
                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                grammar=plan.grammar,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias (token ids as strings) → token id: bias; ids outside the vocabulary are a 400."""
        vocab = self.engine.engine.model_config.vocab_size
        out = {}
        for key, value in (bias or {}).items():
            tok = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= tok < vocab:
                raise APIError(
                    400,
                    f"logit_bias key {key!r} is not a token id of this model (0 to {vocab - 1})",
                    param="logit_bias",
                )
            out[tok] = value
        return out

    # -- serving -------------------------------------------------------------------------------------------
    def fairness_key(self, req: ChatCompletionRequest, caller: str, tenant: str | None) -> str:
        """Whose share of the prefill a request takes: the API key's tenant when keys are configured, else the
        caller's address (server.py); the request's own `user` field only where a gateway in front sets it
        (``fair_share_by_user``), since a client names itself there."""
        base = f"tenant:{tenant}" if tenant is not None else caller
        if self.args.fair_share_by_user and req.user:
            return f"{base}/user:{req.user}"
        return base

    def cache_salt(self, req: ChatCompletionRequest, tenant: str | None) -> str:
        """What keeps this request's cache entries apart from other tenants' (empty: shared with every request
        without one). The tenant's name when keys isolate tenants, and the request's own ``cache_salt``."""
        parts = []
        if tenant is not None and self.args.cache_salt_per_api_key:
            parts.append(["tenant", tenant])
        if req.cache_salt is not None:
            parts.append(["request", req.cache_salt])
        return json.dumps(parts, separators=(",", ":")) if parts else ""

    async def create(
        self, req: ChatCompletionRequest, arrival: float, caller: str = "", tenant: str | None = None
    ) -> dict | StreamingResponse:
        """``caller``: the client's address; ``tenant``: the API key's tenant (None without keys)."""
        model = self.check_model(req.model)
        plan = output_plan(req)
        params = self.sampling_params(req, plan)
        client_key = self.fairness_key(req, caller, tenant)
        salt = self.cache_salt(req, tenant)
        # NOTE: before any media is fetched or decoded: a refusal costs nothing and never waits on a step, and
        # an admitted request counts as queued while it fetches (its prompt's tokens are added once known).
        ticket = self.engine.admit(client_key)
        try:
            if plan.grammar is not None:
                # NOTE: compiled here, on a worker thread, into the engine's cache: the engine thread then only
                # copies it, and a schema that takes a second to compile holds up this request alone.
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.executor, compile_plan, plan, self.engine.engine.grammars)
            prompt = await prepare_prompt(
                self.engine.engine,
                req.messages,
                self.media,
                max_images=self.args.max_images,
                max_videos=self.args.max_videos,
                executor=self.executor,
                cache_salt=salt,
                tools=plan.tools,
            )
            parsing = self._parsing(plan, prompt.token_ids)
            if parsing.thinking and params.grammar is not None:
                params.grammar_after = "</think>"  # the grammar applies to the answer, after the reasoning
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            stream = await self.engine.add_request(
                request_id, prompt, params, client_key=client_key, ticket=ticket, cache_salt=salt
            )
        except BaseException:
            ticket.release()
            raise
        timing = _Timing(arrival)
        outputs = _outputs(stream, timing)
        if not req.stream:
            try:
                return await self._complete(outputs, model, req.return_token_ids, timing, parsing)
            finally:
                stream.close()
        # NOTE: the first output (first token, or the request's failure) comes before the response starts,
        # so a request that fails early (a bad image found while decoding) still gets an HTTP error status.
        try:
            first = await anext(outputs)
        except BaseException:
            stream.close()
            raise
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            self._stream(
                stream,
                _prepend(first, outputs),
                model,
                params.n,
                include_usage,
                list(prompt.token_ids) if req.return_token_ids else None,
                timing,
                parsing,
            ),
            media_type="text/event-stream",
            headers={"X-Request-Id": request_id, **visual_level_header(first.visual_levels)},
        )

    def _parsing(self, plan: OutputPlan, prompt_ids: list[int]) -> Parsing:
        """How the output is read: tool calls where tools were offered; a reasoning block with
        --reasoning-parser, inside one from the first token where the prompt opened it."""
        if not self.args.reasoning_parser:
            return Parsing(tools=plan.parse_tools)
        tail = self.engine.engine.processor.decode(list(prompt_ids[-4:]), skip_special_tokens=False)
        return Parsing(tools=plan.parse_tools, reasoning=True, thinking=tail.rstrip().endswith(THINK_OPEN))

    async def _complete(
        self,
        outputs: AsyncIterator[RequestOutput],
        model: str,
        return_ids: bool,
        timing: _Timing,
        parsing: Parsing,
    ) -> dict:
        final = None
        async for out in outputs:
            final = out
        assert final is not None and final.finished
        self._record(final, timing)
        return completion_body(final, model, return_ids, parsing)

    async def _stream(
        self,
        stream: RequestStream,
        outputs: AsyncIterator[RequestOutput],
        model: str,
        n: int,
        include_usage: bool,
        prompt_ids: list[int] | None,
        timing: _Timing,
        parsing: Parsing,
    ) -> AsyncIterator[str]:
        """SSE chunks; ``prompt_ids`` (given when token ids were asked for) also turns on per-chunk token_ids."""
        chunks = _ChunkWriter(stream.request_id, model, include_usage, prompt_ids is not None, parsing)
        outcome = "aborted"  # unless the loop below completes: a disconnect cancels it mid-way
        try:
            yield chunks.first(n, prompt_ids)
            last = None
            async for out in outputs:
                last = out
                if delta := chunks.deltas(out):
                    yield delta
            assert last is not None and last.finished
            if include_usage:
                yield chunks.chunk([], usage=_usage(last))
            outcome = "ok"
            self._record(last, timing)
        except APIError as err:
            outcome = "error"
            self.metrics.count_error(err.status)
            yield _sse(err.body())
        finally:
            stream.close()
            if outcome == "aborted":
                self.metrics.count("aborted")
        yield "data: [DONE]\n\n"

    def _record(self, out: RequestOutput, timing: _Timing) -> None:
        now = time.monotonic()
        m = self.metrics
        m.count("ok")
        m.e2e.observe(now - timing.arrival)
        if timing.first_token is not None:
            m.ttft.observe(timing.first_token - timing.arrival)
            longest = max(len(c.token_ids) for c in out.outputs)
            if longest > 1:
                m.tpot.observe((now - timing.first_token) / (longest - 1))
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.cached_tokens.inc(out.num_cached_tokens)
        m.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
