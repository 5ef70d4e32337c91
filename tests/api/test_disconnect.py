"""Clients that hang up: their requests are aborted and their KV blocks freed.

The server runs in this process (uvicorn on 127.0.0.1, in a thread) so that the test can hold the engine
thread between steps: a request is provably still running when its client goes away, and the engine takes
no step that the hang-up could have prevented until the server has heard of it. No verdict depends on how
fast the machine generates tokens.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from api.async_engine import AsyncEngine
from api.config import ServerArgs
from api.server import create_app
from lm_engine import EngineConfig, LLMEngine
from tests.support import is_idle, parse_metrics

N_CLIENTS = 20
MAX_TOKENS = 400
WAIT_S = 30.0  # a bound on waiting for a condition, far past any machine's pace: reaching it fails the test


@dataclass
class LiveServer:
    engine: LLMEngine
    async_engine: AsyncEngine
    base_url: str
    http: httpx.Client

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.http.get("/metrics").text)

    def aborted(self) -> float:
        return self.metrics().get("vlmserve_requests_total{status=aborted}", 0.0)

    def wait_idle(self, aborted: float = 0.0) -> dict[str, float]:
        """Metrics once nothing runs or waits, every KV block is free and ``aborted`` requests were counted
        aborted (WAIT_S at most: a condition, not a pace). NOTE: the API counts an abort after the engine
        dropped the request, so an idle engine alone does not mean the count is in."""
        deadline = time.monotonic() + WAIT_S
        while True:
            m = self.metrics()
            counted = m.get("vlmserve_requests_total{status=aborted}", 0.0) >= aborted
            if (is_idle(m) and counted) or time.monotonic() > deadline:
                return m
            time.sleep(0.02)


@pytest.fixture(scope="module")
def live(tiny_ckpt) -> Iterator[LiveServer]:
    config = EngineConfig(
        model=str(tiny_ckpt),
        num_kv_blocks=256,
        max_num_seqs=32,
        max_model_len=512,
        max_num_batched_tokens=512,
    )
    engine = LLMEngine(config)
    app = create_app(ServerArgs(engine=config, served_model_names=["tiny"]), engine=engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with httpx.Client(base_url=base_url, timeout=WAIT_S) as http:
        yield LiveServer(engine, app.state.engine, base_url, http)
    server.should_exit = True
    thread.join(WAIT_S)
    sock.close()


class StepGate:
    """Holds the engine thread before each step while ``hold(gate)`` is true (WAIT_S at most: then ``expired``
    is set and it holds nothing more). Records the request ids the API aborted (a client gone), the requests whose output carried text (what
    a streaming client reads) and how many tokens each had generated after its last step."""

    def __init__(self, live: LiveServer, hold: Callable[[StepGate], bool]) -> None:
        self.live, self.hold = live, hold
        self.cv = threading.Condition()
        self.aborted: set[str] = set()
        self.texted: dict[str, int] = {}  # request id -> tokens it had when its first text went out
        self.tokens: dict[str, int] = {}
        self.holding = threading.Event()  # set once a step has been held
        self.expired = False

    def __enter__(self) -> StepGate:
        engine, async_engine = self.live.engine, self.live.async_engine
        self._real_step, self._real_abort = engine.step, async_engine.abort
        engine.step, async_engine.abort = self._step, self._abort
        return self

    def __exit__(self, *exc) -> None:
        del self.live.engine.step, self.live.async_engine.abort  # the class's own methods again

    def _abort(self, request_id: str) -> None:
        self._real_abort(request_id)  # NOTE: queued for the engine before the gate can let a step through
        with self.cv:
            self.aborted.add(request_id)
            self.cv.notify_all()

    def _step(self):
        with self.cv:
            if not self.expired and self.hold(self):
                self.holding.set()
                if not self.cv.wait_for(lambda: not self.hold(self), WAIT_S):
                    self.expired = True
        outputs = self._real_step()
        with self.cv:
            for out in outputs:
                self.tokens[out.request_id] = max(len(c.token_ids) for c in out.outputs)
                if any(c.delta_text for c in out.outputs):
                    self.texted.setdefault(out.request_id, self.tokens[out.request_id])
        return outputs


def long_request(i: int, **kw) -> dict:
    # ignore_eos + many tokens: left alone, each would run for hundreds of steps.
    return dict(
        model="tiny",
        messages=[{"role": "user", "content": f"Client {i}: tell me everything you know."}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=i,
        extra_body={"ignore_eos": True},
        **kw,
    )


def assert_idle_and_aborted(live: LiveServer, gate: StepGate, aborted_before: float, n: int) -> None:
    m = live.wait_idle(aborted=aborted_before + n)
    assert m["vlmserve_num_requests_running"] == 0
    assert m["vlmserve_num_requests_waiting"] == 0
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
    assert m["vlmserve_requests_total{status=aborted}"] - aborted_before == n
    assert not gate.expired, "the server never heard a client hang up"
    assert not live.engine.has_unfinished()
    live.engine.check_integrity()
    assert live.http.get("/health").status_code == 200


def test_streaming_clients_hanging_up_after_first_token(live):
    """Each request gets one step past the text its client read (the step already let through when the
    hang-up arrived), then the engine drops it."""
    live.wait_idle()
    aborted_before = live.aborted()
    client = live.client()

    def hang_up_after_first_token(i: int) -> None:
        stream = client.chat.completions.create(stream=True, **long_request(i))
        for chunk in stream:
            if any(c.delta.content for c in chunk.choices):
                break
        stream.close()

    # Hold a step while a request whose text went out has not been aborted by the server yet.
    with StepGate(live, lambda g: not g.texted.keys() <= g.aborted) as gate:
        with ThreadPoolExecutor(N_CLIENTS) as pool:
            list(pool.map(hang_up_after_first_token, range(N_CLIENTS)))
        assert_idle_and_aborted(live, gate, aborted_before, N_CLIENTS)
    assert len(gate.texted) == N_CLIENTS and gate.texted.keys() <= gate.aborted
    for request_id, at_first_text in gate.texted.items():
        assert gate.tokens[request_id] <= at_first_text + 1 < MAX_TOKENS, (request_id, gate.tokens)


def test_non_streaming_client_timing_out(live):
    """The client gives up (its timeout) while the engine holds its request, and the engine takes no step for
    the request until the server has aborted it: it is in flight when the client goes away on any machine."""
    live.wait_idle()
    aborted_before = live.aborted()
    body = long_request(99)
    body.update(body.pop("extra_body"))
    engine = live.engine
    with StepGate(live, lambda g: not engine.requests.keys() <= g.aborted) as gate:
        host, port = live.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            data = json.dumps(body).encode()
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            client.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
            assert gate.holding.wait(WAIT_S)  # the engine has the request and holds its first step
            assert engine.has_unfinished()
        # The client's timeout fired: it closed the connection, no answer read.
        assert_idle_and_aborted(live, gate, aborted_before, 1)
    # At most the one step let through after the abort was queued: nowhere near the 400 tokens asked for.
    assert len(gate.aborted) == 1 and all(n <= 1 for n in gate.tokens.values()), gate.tokens
