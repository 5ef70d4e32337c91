"""``vlmserve batch``: an OpenAI batch file (JSONL) in, batch output (JSONL) out, run offline on the engine.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``. Its body is
validated, turned into sampling params, and its images fetched exactly as for an HTTP request (api/protocol.py,
api/chat.py, api/media.py, api/prompt.py). A bad line becomes an error record; the batch goes on. ``stream``
in a body is ignored: every line gets one whole ``chat.completion``.

Cache-aware order. A first pass reads the file once, validates every line and keys it by its images' identity
(xxh3 of the bytes for data: and file: URLs, the URL itself for http(s), which is fetched once only), with each
image's ``detail``. Lines with the same key form a group — a page and its questions — and groups run in order
of first appearance. With prefix caching on, a group's first line (its leader) runs alone; the others are
released when the leader has its first token, i.e. when the page's embedding is cached and its KV blocks are in
the prefix cache, so they prefill only their question. Leaders of up to ``lookahead_groups`` groups run at once
to keep the engine busy; a leader that fails hands the lead to the group's next line. With prefix caching off
nothing is gained by waiting: a group's lines go back to back, and the vision pipeline encodes their shared
image once (from the embedding cache, or de-duplicated in flight).

Memory bound. The first pass keeps a few integers per line (its offset and length in the file, its group),
never a body. A line's body and images are read again when it is submitted, and at most ``max_in_flight``
lines are being prepared or run at a time. Records are appended, as lines finish, to an anonymous spill file;
at the end the output is written from it in input order (under a temporary name, then renamed), so finished
results cost two integers per line until then.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections import deque
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

from pydantic import ValidationError
from tqdm.auto import tqdm

from api.chat import ChatService, Parsing, completion_body
from api.config import ServerArgs
from api.errors import APIError, to_api_error
from api.media import MediaConfig, MediaFetcher
from api.prompt import normalize, prepare_prompt
from api.protocol import ChatCompletionRequest
from api.structured import output_plan
from lm_engine.engine import LLMEngine
from lm_engine.outputs import RequestOutput
from lm_engine.processor import InputError, PromptInputs, normalize_messages
from lm_engine.sampling_params import SamplingParams
from preprocess import image_hash

log = logging.getLogger("vlmserve.batch")

CHAT_URL = "/v1/chat/completions"


@dataclass(slots=True)
class BatchOptions:
    served_model_names: list[str] = field(default_factory=list)  # names a body's "model" may use
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    media: MediaConfig = field(default_factory=MediaConfig)  # file: URLs off unless allowed_local_path
    max_in_flight: int | None = None  # lines prepared or running at once; default 2 × max_num_seqs
    lookahead_groups: int = 4  # groups whose leader runs before the group's other lines are released
    progress: bool = True  # tqdm bar on stderr


@dataclass(slots=True)
class BatchSummary:
    lines: int = 0
    ok: int = 0
    failed: int = 0
    wall_s: float = 0.0
    scan_s: float = 0.0  # the first pass (validation, image hashing, grouping)
    groups: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (usage.cached_tokens)
    completion_tokens: int = 0
    images_encoded: int = 0  # by the vision tower
    # Images whose embedding was reused, not encoded: embedding-cache hits, and images a line found held by
    # another line in flight (encoded once for both).
    embedding_hits: int = 0
    embedding_lookups: int = 0
    prefix_hit_tokens: int = 0  # the block manager's counts (re-admissions after preemption included)
    prefix_query_tokens: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def embedding_hit_rate(self) -> float:
        return self.embedding_hits / self.embedding_lookups if self.embedding_lookups else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "embedding_hit_rate": self.embedding_hit_rate,
            "prefix_hit_rate": self.prefix_hit_rate,
        }

    def report(self) -> str:
        return "\n".join(
            [
                f"lines: {self.lines} ({self.ok} ok, {self.failed} failed) in {self.groups} groups",
                f"wall time: {self.wall_s:.2f}s (first pass {self.scan_s:.2f}s)",
                f"throughput: {self.requests_per_s:.2f} req/s, {self.output_tokens_per_s:.1f} output tok/s "
                f"({self.prompt_tokens} prompt tokens, {self.completion_tokens} output tokens)",
                f"embedding cache: {self.embedding_hit_rate:.1%} reused ({self.embedding_hits}/"
                f"{self.embedding_lookups}: cache hits or shared in flight), {self.images_encoded} images encoded",
                f"prefix cache: {self.prefix_hit_rate:.1%} of prompt tokens hit ({self.prefix_hit_tokens}/"
                f"{self.prefix_query_tokens}); cached_tokens in usage: {self.cached_tokens}",
            ]
        )


def run_batch(
    engine: LLMEngine, input_path: str | Path, output_path: str | Path, options: BatchOptions | None = None
) -> BatchSummary:
    """Run every line of ``input_path`` on ``engine``; write one record per line to ``output_path``, in
    input order. ``engine`` should have no other requests running (its step() outputs are all taken)."""
    run = _BatchRun(engine, options or BatchOptions())
    try:
        return run.run(Path(input_path), Path(output_path))
    finally:
        run.close()


# ---------------------------------------------------------------- one line


class _LineError(Exception):
    """A line that is no batch request at all (bad JSON, url, method): an error record with no response."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


class _Rejected(Exception):
    """A request line the API would answer with an error status."""

    def __init__(self, custom_id: str, error: APIError) -> None:
        super().__init__(error.message)
        self.custom_id = custom_id
        self.error = error


@dataclass(slots=True)
class _Parsed:
    custom_id: str
    model: str
    params: SamplingParams
    messages: list[dict]  # the engine's form: image parts keep their URL and detail
    return_token_ids: bool
    tools: list[dict] | None = None  # offered in the prompt (the server's tool format)
    parsing: Parsing | None = None  # tool calls read out of the output where tools were offered


@dataclass(slots=True)
class _Running:
    """A line in the engine; NOTE: not its messages, whose data: URLs would outlive their use."""

    index: int
    custom_id: str
    model: str
    return_token_ids: bool
    hot: bool = False  # has its first token (its images' KV is in the prefix cache)
    parsing: Parsing | None = None


def _envelope(raw: bytes) -> tuple[str, Any]:
    """The custom_id and body of one input line."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise _LineError("invalid_json_line", f"line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _LineError("invalid_json_line", "line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _LineError("missing_custom_id", "custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise _LineError("invalid_method", "method must be POST", cid)
    if obj.get("url") != CHAT_URL:
        raise _LineError("invalid_url", f"url must be {CHAT_URL}, got {obj.get('url')!r}", cid)
    if "body" not in obj:
        raise _LineError("missing_body", "line has no body", cid)
    return cid, obj["body"]


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _ok_record(custom_id: str, request_id: str, body: dict) -> dict:
    return {
        "id": _new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _error_record(custom_id: str | None, err: APIError | _LineError, request_id: str | None = None) -> dict:
    """A failed line: ``error`` always set; ``response`` holds the HTTP answer when the line was a request."""
    response = None
    if isinstance(err, APIError):
        request_id = request_id or _new_id("chatcmpl-")
        response = {"status_code": err.status, "request_id": request_id, "body": err.body()}
    return {
        "id": _new_id("batch_req_"),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": err.code, "message": err.message},
    }


# ---------------------------------------------------------------- plumbing


class _MediaLoop:
    """An event loop on its own thread for the media fetcher, so batch lines fetch images (and run the chat
    processing) through the same async code, SSRF guard and limits as the server, alongside engine steps."""

    def __init__(self, config: MediaConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vlmserve-batch-media", daemon=True)
        self.thread.start()
        self.fetcher: MediaFetcher = self.call(self._make_fetcher(config))

    @staticmethod
    async def _make_fetcher(config: MediaConfig) -> MediaFetcher:
        return MediaFetcher(config)

    def submit(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine) -> Any:
        return self.submit(coro).result()

    def close(self) -> None:
        try:
            self.call(self.fetcher.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
            self.loop.close()


class _Spill:
    """Records in finishing order on disk, with each line's place; written out in input order at the end."""

    def __init__(self, directory: Path) -> None:
        # Closed by close(); anonymous, so nothing is left behind even if the process dies.
        self.file: BinaryIO = tempfile.TemporaryFile(dir=directory, prefix=".vlmserve-batch-")  # noqa: SIM115
        self.pos = 0
        self.offsets = array("q")
        self.lengths = array("q")

    def add_line(self) -> int:
        self.offsets.append(-1)
        self.lengths.append(0)
        return len(self.offsets) - 1

    def put(self, index: int, record: dict) -> None:
        assert self.offsets[index] < 0, f"line {index} written twice"
        data = json.dumps(record, ensure_ascii=False).encode() + b"\n"
        self.file.seek(self.pos)
        self.file.write(data)
        self.offsets[index], self.lengths[index] = self.pos, len(data)
        self.pos += len(data)

    def write_ordered(self, path: Path) -> None:
        missing = [i for i, off in enumerate(self.offsets) if off < 0]
        assert not missing, f"lines without a record: {missing[:10]}"
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                for off, length in zip(self.offsets, self.lengths):
                    self.file.seek(off)
                    out.write(self.file.read(length))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def close(self) -> None:
        self.file.close()


class _Feeder:
    """Lines in cache-aware order: a group's leader first; the rest of the group once the leader is hot."""

    def __init__(self, groups: Iterable[list[int]], lookahead: int, hold: bool = True) -> None:
        self.groups = deque(groups)
        self.lookahead = max(1, lookahead)
        self.hold = hold  # False: no leader waits; a group's lines simply go back to back
        self.ready: deque[int] = deque()
        self.held: dict[int, deque[int]] = {}  # leader → the lines of its group waiting for it

    def next(self) -> int | None:
        if self.ready:
            return self.ready.popleft()
        if self.groups and len(self.held) < self.lookahead:
            leader, *rest = self.groups.popleft()
            if not self.hold:
                self.ready.extend(rest)
            elif rest:
                self.held[leader] = deque(rest)
            return leader
        return None

    def hot(self, line: int) -> None:
        """``line`` has its first token: if it leads a group, release the group."""
        self.ready.extend(self.held.pop(line, ()))

    def failed(self, line: int) -> None:
        """``line`` failed before its page was cached: if it led a group, the group's next line leads."""
        rest = self.held.pop(line, None)
        if rest:
            leader = rest.popleft()
            if rest:
                self.held[leader] = rest
            self.ready.append(leader)

    @property
    def exhausted(self) -> bool:
        return not (self.ready or self.groups or self.held)


# ---------------------------------------------------------------- the run


class _BatchRun:
    def __init__(self, engine: LLMEngine, options: BatchOptions) -> None:
        self.engine = engine
        self.options = options
        self.args = ServerArgs(
            engine=engine.config,
            served_model_names=list(options.served_model_names),
            limit_mm_per_prompt=dict(options.limit_mm_per_prompt),
            media=options.media,
        )
        self.media = _MediaLoop(options.media)
        # NOTE: only ChatService's validation (check_model, sampling_params) is used; it reads the engine's
        # config through ``.engine.engine`` and nothing else, so a plain holder stands in for the AsyncEngine.
        self.chat = ChatService(
            self.args, SimpleNamespace(engine=engine), self.media.fetcher, metrics=None, executor=None
        )
        self.max_in_flight = options.max_in_flight or 2 * engine.config.max_num_seqs
        self.summary = BatchSummary()
        self.bar: tqdm | None = None
        self._t0 = time.perf_counter()

    def close(self) -> None:
        self.media.close()

    # -- parsing -------------------------------------------------------------------------------------------
    def _parse(self, raw: bytes) -> _Parsed:
        """A line validated exactly as the HTTP route validates a body; raises _LineError or _Rejected."""
        cid, body = _envelope(raw)
        try:
            req = ChatCompletionRequest.model_validate(body)
            model = self.chat.check_model(req.model)
            plan = output_plan(req)
            params = self.chat.sampling_params(req, plan)
            messages = [m.to_engine() for m in req.messages]
            normalize(messages, self.args.max_images)
        except (APIError, InputError, ValidationError) as err:
            raise _Rejected(cid, to_api_error(err)) from None
        return _Parsed(
            cid, model, params, messages, req.return_token_ids, plan.tools, Parsing(tools=plan.parse_tools)
        )

    async def _group_key(self, messages: list[dict]) -> tuple | None:
        """The identity of a line's images (with their detail), or None for a text-only line."""
        key = []
        for image in normalize_messages(messages).images:
            url, detail = image.source, image.detail
            if url.split(":", 1)[0].lower() in ("http", "https"):
                key.append((url, detail))  # NOTE: fetched once, when the line runs, not here too
            else:
                # NOTE: xxh3 whatever --hash-algorithm says: this key only orders lines (a collision groups two
                # pages, which costs a wait, never a wrong answer); the engine keys the image itself.
                key.append((image_hash(await self.media.fetcher.fetch(url), "xxh3"), detail))
        return tuple(key) or None

    # -- pass 1 --------------------------------------------------------------------------------------------
    def _scan(self, src: BinaryIO, spill: _Spill) -> tuple[array, array, list[list[int]]]:
        """Validate and group every line; failed lines get their record now."""
        offsets, lengths = array("q"), array("q")
        groups: dict[tuple, list[int]] = {}
        pos = 0
        scan = tqdm(
            src, desc="scan", unit="line", file=sys.stderr, disable=not self.options.progress, leave=False
        )
        for raw in scan:
            start, pos = pos, pos + len(raw)
            if not raw.strip():
                continue  # blank lines are not lines of the batch
            index = spill.add_line()
            offsets.append(start)
            lengths.append(len(raw))
            try:
                parsed = self._parse(raw)
                key = self.media.call(self._group_key(parsed.messages))
            except _LineError as err:
                self._fail(spill, index, err.custom_id, err)
                continue
            except _Rejected as rej:
                self._fail(spill, index, rej.custom_id, rej.error)
                continue
            except Exception as exc:  # fetching an image: an APIError, unless something unforeseen broke
                self._fail(spill, index, parsed.custom_id, to_api_error(exc))
                continue
            groups.setdefault(key if key is not None else ("text", index), []).append(index)
        return offsets, lengths, list(groups.values())

    # -- pass 2 --------------------------------------------------------------------------------------------
    def run(self, input_path: Path, output_path: Path) -> BatchSummary:
        self._t0 = t0 = time.perf_counter()
        s = self.summary
        vision, bm = self.engine.vision.stats, self.engine.block_manager
        shared = self.engine.images
        start = (
            vision.images,
            vision.cache_hits + shared.shared,
            vision.cache_misses,
            bm.prefix_hits,
            bm.prefix_queries,
        )
        output_path.parent.mkdir(parents=True, exist_ok=True)
        spill = _Spill(output_path.parent)
        try:
            with open(input_path, "rb") as src:
                offsets, lengths, groups = self._scan(src, spill)
                s.lines, s.groups, s.scan_s = len(offsets), len(groups), time.perf_counter() - t0
                self.bar = tqdm(
                    total=s.lines,
                    initial=s.failed,
                    desc="batch",
                    unit="req",
                    file=sys.stderr,
                    disable=not self.options.progress,
                    dynamic_ncols=True,
                )
                self._run(src, offsets, lengths, groups, spill)
                self.bar.close()
            spill.write_ordered(output_path)
        finally:
            spill.close()
            if self.bar is not None:
                self.bar.close()
        s.wall_s = time.perf_counter() - t0
        s.images_encoded = vision.images - start[0]
        s.embedding_hits = vision.cache_hits + shared.shared - start[1]
        s.embedding_lookups = s.embedding_hits + vision.cache_misses - start[2]
        s.prefix_hit_tokens = bm.prefix_hits - start[3]
        s.prefix_query_tokens = bm.prefix_queries - start[4]
        return s

    def _run(
        self, src: BinaryIO, offsets: array, lengths: array, groups: list[list[int]], spill: _Spill
    ) -> None:
        # NOTE: holding a page's other questions back only pays when its KV can be reused.
        feeder = _Feeder(groups, self.options.lookahead_groups, hold=self.engine.config.enable_prefix_caching)
        running: dict[str, _Running] = {}  # engine request id → line
        preparing: deque[tuple[int, _Parsed, Future]] = deque()
        engine = self.engine
        while True:
            while len(preparing) + len(running) < self.max_in_flight:
                index = feeder.next()
                if index is None:
                    break
                src.seek(offsets[index])
                try:
                    parsed = self._parse(src.read(lengths[index]))
                except (_LineError, _Rejected) as exc:  # only if the file changed since the first pass
                    err = exc.error if isinstance(exc, _Rejected) else exc
                    self._fail(spill, index, exc.custom_id, err)
                    feeder.failed(index)
                    continue
                preparing.append((index, parsed, self.media.submit(self._prepare(parsed))))
            # NOTE: submitted strictly in feeder order (the head first), whatever order the fetches end in.
            while preparing and preparing[0][2].done():
                index, parsed, fut = preparing.popleft()
                self._submit(index, parsed, fut, running, feeder, spill)
            if engine.has_unfinished():
                for out in engine.step():
                    self._on_output(out, running, feeder, spill)
            elif preparing:
                wait_futures([preparing[0][2]], timeout=1.0)
            elif feeder.exhausted:
                return
            else:
                raise AssertionError("batch stalled: lines held back with nothing running")

    async def _prepare(self, parsed: _Parsed) -> PromptInputs:
        return await prepare_prompt(
            self.engine,
            parsed.messages,
            self.media.fetcher,
            max_images=self.args.max_images,
            tools=parsed.tools,
        )

    def _submit(
        self,
        index: int,
        parsed: _Parsed,
        fut: Future,
        running: dict[str, _Running],
        feeder: _Feeder,
        spill: _Spill,
    ) -> None:
        request_id = _new_id("chatcmpl-")
        try:
            prompt = fut.result()
            self.engine.add_request(request_id, prompt, parsed.params)
        except Exception as exc:
            self._fail(spill, index, parsed.custom_id, to_api_error(exc), request_id)
            feeder.failed(index)
            return
        running[request_id] = _Running(
            index, parsed.custom_id, parsed.model, parsed.return_token_ids, parsing=parsed.parsing
        )

    def _on_output(
        self, out: RequestOutput, running: dict[str, _Running], feeder: _Feeder, spill: _Spill
    ) -> None:
        run = running.get(out.request_id)
        if run is None:
            return  # not ours
        if out.error is not None:
            del running[out.request_id]
            err = to_api_error(out.error)
            self._fail(spill, run.index, run.custom_id, err, out.request_id)
            feeder.failed(run.index)
            return
        if not run.hot and (out.finished or any(c.token_ids for c in out.outputs)):
            run.hot = True
            feeder.hot(run.index)
        if not out.finished:
            return
        del running[out.request_id]
        body = completion_body(out, run.model, run.return_token_ids, run.parsing)
        spill.put(run.index, _ok_record(run.custom_id, out.request_id, body))
        s = self.summary
        s.ok += 1
        s.prompt_tokens += len(out.prompt_token_ids)
        s.cached_tokens += out.num_cached_tokens
        s.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self._tick()

    def _fail(
        self,
        spill: _Spill,
        index: int,
        custom_id: str | None,
        err: APIError | _LineError,
        request_id: str | None = None,
    ) -> None:
        spill.put(index, _error_record(custom_id, err, request_id))
        self.summary.failed += 1
        self._tick()

    def _tick(self) -> None:
        if self.bar is None:
            return  # first pass: the bar starts with these
        elapsed = time.perf_counter() - self._t0
        self.bar.set_postfix_str(
            f"{self.summary.completion_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False
        )
        self.bar.update(1)
