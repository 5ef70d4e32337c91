"""The engine on its own thread, bridged to asyncio.

The engine is not thread-safe, so one thread owns it: it drains a command list (add, abort), runs a
step while anything is unfinished, and sleeps on a condition when idle. Outputs go back to each
request's stream through ``loop.call_soon_threadsafe``, one callback per step. The event loop never
calls into the engine and never waits on it except through those streams.

Admission control runs on the event loop, so a refusal never waits for a step to end: the engine's
``Admission`` (lm_engine/admission.py) is thread-safe and reads the state the engine published after its
last step. An admitted request's ticket travels with it to the engine, which releases it when the scheduler
first runs the request or it ends; a request closed, refused or failed before that releases it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from lm_engine.admission import Ticket
from lm_engine.device import is_fatal_device_error
from lm_engine.engine import LLMEngine
from lm_engine.outputs import RequestOutput
from lm_engine.processor import InputError, PromptInputs
from lm_engine.sampling_params import SamplingParams

log = logging.getLogger("vlmserve.async_engine")


class EngineFailure(RuntimeError):
    """The engine failed while running a request (a server fault, not the client's)."""


class EngineDead(RuntimeError):
    """The engine thread is not running; nothing can be served."""


@dataclass(slots=True, frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after each iteration (read by /metrics and /health)."""

    alive: bool = False
    running_requests: int = 0
    waiting_requests: int = 0
    running_seqs: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0
    preemptions: int = 0
    visual_level: int = 0  # the visual budget level new detail=auto images get (0 = full resolution)
    overloaded: bool = False  # admission control refuses new work (the queue ahead takes longer than the SLO)
    expected_wait_s: float = 0.0  # of the queued prefill work at the measured throughput (0: not measured)
    # What the engine holds: per request (0 when idle) and by design (bounded by the pool / the flags).
    requests_tracked: int = 0
    encoded_images: int = 0  # image embeddings held for live requests
    encoded_image_bytes: int = 0
    prefix_index_entries: int = 0  # KV blocks the prefix cache indexes (at most total_blocks)
    kv_cache_bytes: int = 0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptInputs
    params: SamplingParams
    client_key: str
    stream: RequestStream
    ticket: Ticket
    cache_salt: str = ""


@dataclass(slots=True)
class _Abort:
    request_id: str


def _merge(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """``new`` carrying the deltas of ``old`` too (outputs are cumulative but for their deltas)."""
    prev = {c.index: c for c in old.outputs}
    for c in new.outputs:
        if (p := prev.get(c.index)) is not None:
            c.delta_text = p.delta_text + c.delta_text
            c.delta_token_ids = p.delta_token_ids + c.delta_token_ids
            if c.delta_logprobs is not None and p.delta_logprobs is not None:
                c.delta_logprobs = p.delta_logprobs + c.delta_logprobs
    return new


@dataclass(slots=True, eq=False)
class RequestStream:
    """One request's outputs; iterate it, and ``close()`` it when done (aborts if unfinished).

    Outputs not yet read merge into one, so a slow reader costs O(tokens) memory, not O(tokens²), and
    gets its deltas in bigger pieces rather than falling further behind.
    """

    request_id: str
    owner: AsyncEngine
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    finished: bool = False
    ticket: Ticket | None = None  # its place in the admission queue, until scheduled or ended
    _pending: RequestOutput | BaseException | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop."""
        if isinstance(item, BaseException) or item.finished:
            self._release()
        prev = self._pending
        if isinstance(prev, BaseException):
            return  # the request already failed
        if prev is None or isinstance(item, BaseException):
            self._pending = item
        else:
            self._pending = _merge(prev, item)
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            await self._ready.wait()
            self._ready.clear()
            item, self._pending = self._pending, None
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def _release(self) -> None:
        if self.ticket is not None:
            self.ticket.release()

    def close(self) -> None:
        self._release()
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)

    def __del__(self) -> None:
        # Safety net: a stream dropped unread (a response never started) must not keep generating.
        self.close()


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = EngineStats(
            total_blocks=engine.block_manager.num_blocks, kv_cache_bytes=engine.kv_cache_bytes
        )
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, RequestStream] = {}  # engine thread only

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="vlmserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %.0fs", timeout)
                return
        self.engine.close()  # the vision pipeline's threads and processes

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    # -- the asyncio side ----------------------------------------------------------------------------------
    def admit(self, client_key: str = "") -> Ticket:
        """A place in the admission queue for a request whose prompt is not built yet (raises EngineOverloaded
        when it must be refused); never waits on the engine thread. Take it before any work on the request
        (media, preprocessing), so requests fetching their images count as queued; ``add_request`` adds the
        prompt's tokens to it. Whoever took it releases it if the request never gets that far."""
        return self.engine.admission.admit(0, client_key)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInputs,
        params: SamplingParams,
        client_key: str = "",
        ticket: Ticket | None = None,
        cache_salt: str = "",
    ) -> RequestStream:
        """Submit a request; returns once the engine accepted it. Raises EngineOverloaded at once when
        admission control refuses it, InputError if the engine refused it. ``ticket``: the one ``admit`` gave
        (its prompt tokens are added to it), else one is taken here. ``cache_salt``: see LLMEngine.add_request."""
        ticket = self.engine.admission.admit(len(prompt.token_ids), client_key, ticket=ticket)
        stream = RequestStream(request_id, self, ticket=ticket)
        try:
            self._submit(_Add(request_id, prompt, params, client_key, stream, ticket, cache_salt))
            await stream.accepted
        except BaseException:
            stream.close()  # cancelled while waiting (client gone), or refused: nothing may stay behind
            raise
        return stream

    def abort(self, request_id: str) -> None:
        with contextlib.suppress(EngineDead):  # nothing runs any more
            self._submit(_Abort(request_id))

    def _submit(self, cmd: _Add | _Abort) -> None:
        with self._cv:
            if self._stop or self._thread is None:
                raise EngineDead("the engine is not running")
            self._commands.append(cmd)
            self._cv.notify()

    def _post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop (from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self._loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream, item in items:
            stream.push(item)

    @staticmethod
    def _settle(stream: RequestStream, exc: BaseException | None) -> None:
        if stream.accepted.done():
            return
        if exc is None:
            stream.accepted.set_result(None)
        else:
            stream.accepted.set_exception(exc)

    # -- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            idle_steps = 0
            while True:
                with self._cv:
                    while not self._commands and not self._stop and not self.engine.has_unfinished():
                        self._publish()
                        self._cv.wait()
                    if self._stop:
                        break
                    if idle_steps and not self._commands:
                        # Work exists but the scheduler placed nothing last time: wait a moment, don't spin.
                        self._cv.wait(0.005)
                    commands, self._commands = self._commands, []
                for cmd in commands:
                    self._apply(cmd)
                if self.engine.has_unfinished():
                    before = self.engine.step_count
                    self._step()
                    idle_steps = 0 if self.engine.step_count != before else idle_steps + 1
                self._publish()
            self._fail_all(EngineDead("the server is shutting down"))
        except BaseException as exc:
            log.exception("the engine thread died; failing every request")
            self.error = exc
            self._fail_all(EngineDead(f"the engine stopped: {type(exc).__name__}: {exc}"))
        finally:
            self.stats = dataclasses.replace(self.stats, alive=False)

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            self._live.pop(cmd.request_id, None)
            self.engine.abort(cmd.request_id)
            return
        if cmd.stream.finished:  # closed before the engine saw it
            self._post(self._settle, cmd.stream, EngineFailure("request closed before it started"))
            return
        try:
            # NOTE: admission control already ran on the event loop (the ticket); deciding again here would
            # make a refusal wait for the step in progress.
            self.engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                cmd.client_key,
                ticket=cmd.ticket,
                cache_salt=cmd.cache_salt,
            )
        except InputError as exc:  # the client's error
            self._post(self._settle, cmd.stream, exc)
            return
        except Exception as exc:
            log.exception("engine refused request %s", cmd.request_id)
            self._post(
                self._settle, cmd.stream, EngineFailure(f"the engine could not add the request: {exc}")
            )
            return
        self._live[cmd.request_id] = cmd.stream
        self._post(self._settle, cmd.stream, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_step(exc)
            return
        items = []
        for out in outputs:
            stream = self._live.pop(out.request_id, None) if out.finished else self._live.get(out.request_id)
            if stream is not None:
                items.append((stream, out))
        if items:
            self._post(self._deliver, items)

    def _fail_step(self, exc: Exception) -> None:
        """A failed step: fail every request in flight (which ones the step touched is unknown) and free their
        blocks; keep serving only if the device is usable and the block manager's invariants still hold."""
        log.exception("engine step failed; failing %d request(s)", len(self._live))
        failed = list(self._live.items())
        self._live.clear()
        for request_id, _ in failed:
            self.engine.abort(request_id)
        err = EngineFailure(f"the engine failed while running this request: {type(exc).__name__}")
        items = [(stream, err) for _, stream in failed]
        try:
            if is_fatal_device_error(exc):
                raise exc  # NOTE: a device-side assert or illegal address poisons every later kernel
            self.engine.check_integrity()
        except BaseException:
            # The thread ends. Mark it not alive before any client hears of the failure, so a /health sent
            # right after the error already reads not ready.
            with self._cv:
                self._stop = True
            self._post(self._deliver, items)
            raise
        self._post(self._deliver, items)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            self._stop = True  # from here on, _submit refuses: nothing can wait on a dead thread
            pending, self._commands = self._commands, []
        items = [(stream, exc) for stream in self._live.values()]
        self._live.clear()
        self._post(self._deliver, items)
        for cmd in pending:
            if isinstance(cmd, _Add):
                self._post(self._settle, cmd.stream, exc)

    def _publish(self) -> None:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        self.stats = EngineStats(
            alive=True,
            running_requests=len({s.request_id for s in sched.running}),
            waiting_requests=len({s.request_id for s in sched.waiting}),
            running_seqs=len(sched.running),
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            steps=self.engine.step_count,
            preemptions=sched.num_preemptions,
            visual_level=self.engine.load.visual_budget.level_for("auto"),
            overloaded=self.engine.admission.state.overloaded,
            expected_wait_s=self.engine.admission.state.expected_wait_s or 0.0,
            requests_tracked=len(self.engine.requests),
            encoded_images=len(ready := self.engine.images.ready),
            encoded_image_bytes=sum(t.nbytes for t in ready.values()),
            prefix_index_entries=len(bm.index),
            kv_cache_bytes=self.engine.kv_cache_bytes,
        )
