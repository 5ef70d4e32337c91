"""Per-request state ends with its request.

200 requests through the app in this process (plain and streamed, n > 1, with images, refused as bad input,
failed by an undecodable image, aborted by their client) and, once they are all answered, nothing
request-scoped is reachable: no request state, sequence, output, stream, ticket or prompt object alive
anywhere in the process, the engine's and the API's tables empty, every KV block and admission count given
back, and /metrics carrying no more series than it did after the first few requests.
"""

from __future__ import annotations

import asyncio
import base64
import gc
from collections import Counter

import httpx
import pytest
from fastapi.testclient import TestClient

from api.async_engine import RequestStream
from api.config import ServerArgs
from api.server import create_app
from lm_engine.admission import Ticket
from lm_engine.config import EngineConfig
from lm_engine.output_processor import RequestState
from lm_engine.outputs import CompletionOutput, RequestOutput
from lm_engine.processor import ChatInput, ImageInput, PromptInputs
from lm_engine.sampling_params import SamplingParams
from lm_engine.sequence import Sequence
from tests.support import make_image

REQUEST_SCOPED = (
    Sequence,
    RequestState,
    RequestOutput,
    CompletionOutput,
    RequestStream,
    Ticket,
    PromptInputs,
    ChatInput,
    ImageInput,
)
ROUNDS = 20  # of the 10 kinds below: 200 requests


def _image_url(width: int, height: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(make_image(width, height, seed)).decode()


def _truncated_png(seed: int) -> str:
    """Its header reads (so the engine takes it), its pixels do not: it fails while being decoded."""
    return "data:image/png;base64," + base64.b64encode(make_image(200, 150, seed)[:400]).decode()


def _bodies(round_: int) -> list[dict]:
    """Ten requests of different kinds; the images are new each round (no cache hit carries a request)."""
    s = 1000 * round_

    def chat(*content, **extra) -> dict:
        parts = [c if isinstance(c, dict) else {"type": "text", "text": c} for c in content]
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "temperature": 0, **extra}

    def image(w: int, h: int, seed: int) -> dict:
        return {"type": "image_url", "image_url": {"url": _image_url(w, h, seed)}}

    return [
        chat(f"hello number {round_}"),
        chat("tell me more " * (1 + round_ % 7)),
        chat(image(64 + round_, 48, s + 1), "what is this?"),
        chat(image(120, 90 + round_, s + 2), "and this?", stream=True),
        chat(image(56, 56, s + 3), image(80, 60, s + 4), "compare", n=2, temperature=1.0, seed=round_),
        chat("stream me", stream=True, stream_options={"include_usage": True}),
        chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "bad"),
        chat({"type": "image_url", "image_url": {"url": _truncated_png(s + 5)}}, "fails in the engine"),
        chat("too many tokens", max_tokens=-1),  # refused by validation: a 400 before the engine
        chat("stop early", stop=["e"], max_tokens=5),
    ]


async def _round(app, round_: int) -> list[int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
        resps = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in _bodies(round_)))
    return [r.status_code for r in resps]


async def _aborted(app, round_: int) -> None:
    """A request whose client goes away after it was accepted: the stream is closed unread."""
    engine = app.state.engine
    prompt = engine.engine.process_chat([{"role": "user", "content": f"abandon me {round_}"}])
    stream = await engine.add_request(f"abandoned-{round_}", prompt, SamplingParams(max_tokens=50))
    stream.close()


def _alive() -> dict[str, int]:
    gc.collect()
    counts = Counter(type(obj) for obj in gc.get_objects())  # NOTE: type(), not isinstance: no proxies
    return {t.__name__: counts[t] for t in REQUEST_SCOPED if counts[t]}


def _series(client: TestClient) -> set[str]:
    """The metric series /metrics shows (name and labels, not values)."""
    text = client.get("/metrics").text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _wait_idle(client: TestClient) -> None:
    """Until the engine thread has taken every abort and finished everything (it publishes when idle)."""
    engine = client.app.state.engine
    for _ in range(500):
        if not engine.engine.has_unfinished() and not engine._commands:
            return
        client.portal.call(asyncio.sleep, 0.02)
    pytest.fail("the engine did not go idle")


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    args = ServerArgs(engine=EngineConfig(model=str(tiny_ckpt), num_kv_blocks=256, max_queued_requests=64))
    with TestClient(create_app(args), raise_server_exceptions=False) as c:
        yield c


def test_no_request_state_outlives_its_request(client):
    app = client.app
    # NOTE: other tests' apps may have left objects of these types in this process; only this app's count.
    before = _alive()
    statuses = client.portal.call(_round, app, 0)
    assert statuses == [200] * 6 + [400, 400, 400, 200], statuses
    client.portal.call(_aborted, app, 0)
    _wait_idle(client)
    series = _series(client)
    for round_ in range(1, ROUNDS):
        assert client.portal.call(_round, app, round_) == statuses
        client.portal.call(_aborted, app, round_)
    _wait_idle(client)

    assert _alive() == before, "request-scoped objects still reachable after every request ended"
    engine = app.state.engine.engine
    assert engine.requests == {} and app.state.engine._live == {}
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.images.ready == {} and engine.images.failed == {} and not engine.images._holders
    assert (engine.admission.queued_requests, engine.admission.queued_tokens) == (0, 0)
    assert engine.vision.pending == 0
    # Counters and histograms move; no series is added per request (ids, clients, images).
    assert _series(client) == series
