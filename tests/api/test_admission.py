"""Admission control at the API, in process: refusals are decided on the event loop, before any media is
fetched and without waiting for the engine thread, and the queue counts behind them never leak.

"Without waiting" is shown by order, not by a stopwatch: the engine's step is held until the test lets it go,
and the refusal must arrive while it is still held.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from api.async_engine import AsyncEngine, EngineFailure
from api.config import ServerArgs
from api.media import MediaFetcher
from api.server import CHAT_PATH, create_app
from lm_engine import EngineConfig, EngineOverloaded, LLMEngine, SamplingParams
from lm_engine.admission import AdmissionState
from lm_engine.processor import InputError
from tests.support import make_image, user

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
PNG_URL = "data:image/png;base64," + base64.b64encode(make_image(64, 48, 3)).decode()
WITH_IMAGE = {
    **CHAT,
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": PNG_URL}},
                {"type": "text", "text": "what?"},
            ],
        }
    ],
}
WAIT_S = 60.0  # a bound on waiting for a condition, far past any machine's pace: reaching it fails the test


class StalledStep:
    """Replaces ``engine.step``: each step blocks until the test sets ``release``, then runs. (A safety bound
    of 2 × WAIT_S keeps a broken test from hanging; ``expired`` says it was reached.)"""

    def __init__(self, engine: LLMEngine) -> None:
        self.real = engine.step
        self.entered = threading.Event()
        self.release = threading.Event()
        self.expired = False
        engine.step = self.step

    def step(self):
        self.entered.set()
        if not self.release.wait(2 * WAIT_S):
            self.expired = True
        return self.real()


def post_while_stalled(client: TestClient, stall: StalledStep, body: dict):
    """POST ``body`` while the engine is held in a step; returns the response, which must come back before
    the step is let go (a refusal that waited for the engine would never come)."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, CHAT_PATH, json=body)
        try:
            resp = pending.result(timeout=WAIT_S)
            assert not stall.release.is_set() and not stall.expired
            return resp
        finally:
            stall.release.set()


@pytest.fixture
def fetches(monkeypatch) -> list[str]:
    """The URLs the server fetched (data: URLs included)."""
    seen: list[str] = []
    real = MediaFetcher.fetch

    async def counting(self, url: str):
        seen.append(url)
        return await real(self, url)

    monkeypatch.setattr(MediaFetcher, "fetch", counting)
    return seen


def make_client(ckpt, server_kw: dict | None = None, **engine_kw) -> TestClient:
    args = ServerArgs(
        engine=EngineConfig(model=str(ckpt), num_kv_blocks=64, **engine_kw), **(server_kw or {})
    )
    return TestClient(create_app(args), raise_server_exceptions=False)


def assert_overloaded(resp, retry_after: int | None = None) -> None:
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert (
        err["type"] == "server_error"
        and err["code"] == "overloaded"
        and err["message"].startswith("overloaded")
    )
    assert int(resp.headers["Retry-After"]) >= 1
    if retry_after is not None:
        assert int(resp.headers["Retry-After"]) == retry_after


def test_full_queue_refuses_at_once_while_the_engine_is_in_a_long_step(tiny_ckpt, fetches):
    with make_client(tiny_ckpt, max_queued_requests=1) as client:
        stall = StalledStep(client.app.state.engine.engine)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, CHAT_PATH, json=CHAT)
            assert stall.entered.wait(WAIT_S)  # the first request is queued; its step is under way
            resp = post_while_stalled(client, stall, WITH_IMAGE)
            assert first.result().status_code == 200
        assert_overloaded(resp)
        assert fetches == []  # refused before its image was fetched
        assert "1 requests are already queued" in resp.json()["error"]["message"]
        # Once the first request was admitted, the queue has room again.
        assert client.post(CHAT_PATH, json=WITH_IMAGE).status_code == 200
        assert fetches == [PNG_URL]
        assert 'vlmserve_requests_total{status="unavailable"} 1.0' in client.get("/metrics").text


def test_saturated_engine_refuses_at_once_while_in_a_long_step(tiny_ckpt, fetches):
    with make_client(tiny_ckpt, visual_budget="adaptive") as client:
        engine = client.app.state.engine.engine
        stall = StalledStep(engine)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, CHAT_PATH, json=CHAT)
            assert stall.entered.wait(WAIT_S)
            # What the controller's update would publish with too much queued (the step in progress
            # publishes again only when it ends).
            engine.admission.state = AdmissionState(
                True, 4.2, "9.0 s of queued work is ahead of a new request", 9.0
            )
            resp = post_while_stalled(client, stall, WITH_IMAGE)
            assert first.result().status_code == 200  # admitted before: never dropped
        assert_overloaded(resp, retry_after=5)
        assert fetches == []
        assert "9.0 s of queued work is ahead" in resp.json()["error"]["message"]
        # The step's end published the real state: an idle engine refuses nothing.
        assert not engine.admission.state.overloaded
        assert client.post(CHAT_PATH, json=WITH_IMAGE).status_code == 200
        assert "vlmserve_admission_overloaded 0.0" in client.get("/metrics").text


def overloaded_by(engine: LLMEngine, client: str) -> None:
    """What a step would publish with 9 s of ``client``'s work queued (the engine is idle: nothing replaces it)."""
    from types import MappingProxyType

    engine.admission.state = AdmissionState(
        True, 9.0, "9.0 s of queued work is ahead of a new request", 9.0,
        MappingProxyType({client: 9000}), 1000.0, 1.5,
    )  # fmt: skip


def test_overload_refuses_the_tenant_whose_queue_it_is_and_admits_another(tiny_ckpt, fetches):
    """With API keys the fairness key is the key's tenant: with the queue all one tenant's, that tenant is refused
    (whatever `user` it names) and another one, which fair sharing would serve in time, is not."""
    keys = {"hog-key": "hog", "polite-key": "polite"}
    with make_client(tiny_ckpt, server_kw={"api_keys": keys}, visual_budget="adaptive") as client:
        overloaded_by(client.app.state.engine.engine, "tenant:hog")
        for user in (None, "polite", "someone-new"):  # naming another client changes nothing
            body = {**WITH_IMAGE, "user": user} if user else WITH_IMAGE
            resp = client.post(CHAT_PATH, json=body, headers={"Authorization": "Bearer hog-key"})
            assert_overloaded(resp, retry_after=9)
        assert fetches == []  # refused before the image was fetched
        ok = client.post(CHAT_PATH, json=WITH_IMAGE, headers={"Authorization": "Bearer polite-key"})
        assert ok.status_code == 200
        assert fetches == [PNG_URL]


def test_without_keys_the_fair_share_is_the_callers_address_not_its_user_field(tiny_ckpt, fetches):
    """A client that names a new `user` in each request would take a new fair share each time (and one that names
    a victim would get the victim refused): the field counts only behind a gateway that sets it."""
    with make_client(tiny_ckpt, visual_budget="adaptive") as client:
        overloaded_by(client.app.state.engine.engine, "testclient")  # TestClient's address
        for user in ("polite", "someone-new"):
            assert_overloaded(client.post(CHAT_PATH, json={**WITH_IMAGE, "user": user}), retry_after=9)
        assert fetches == []
    with make_client(tiny_ckpt, server_kw={"fair_share_by_user": True}, visual_budget="adaptive") as client:
        overloaded_by(client.app.state.engine.engine, "testclient/user:hog")
        assert_overloaded(client.post(CHAT_PATH, json={**WITH_IMAGE, "user": "hog"}), retry_after=9)
        assert client.post(CHAT_PATH, json={**WITH_IMAGE, "user": "polite"}).status_code == 200


def test_a_request_fetching_its_images_counts_as_queued(tiny_ckpt, monkeypatch):
    """Admission counts a request before its media is fetched: requests whose fetches are slow cannot pile up
    past --max-queued-requests uncounted (each holding its images' bytes)."""
    fetching, release = threading.Event(), threading.Event()
    real = MediaFetcher.fetch

    async def slow(self, url: str):
        fetching.set()
        await asyncio.to_thread(release.wait, 2 * WAIT_S)
        return await real(self, url)

    monkeypatch.setattr(MediaFetcher, "fetch", slow)
    with make_client(tiny_ckpt, max_queued_requests=1) as client:
        admission = client.app.state.engine.engine.admission
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, CHAT_PATH, json=WITH_IMAGE)
            assert fetching.wait(WAIT_S)
            assert admission.queued_requests == 1
            resp = client.post(CHAT_PATH, json=CHAT)
            release.set()
            assert first.result().status_code == 200
        assert_overloaded(resp)
        assert "1 requests are already queued" in resp.json()["error"]["message"]
        assert admission.queued_requests == 0 and admission.queued_tokens == 0
        assert client.post(CHAT_PATH, json=CHAT).status_code == 200


def test_queued_token_bound_is_checked_with_the_prompt_size(tiny_ckpt):
    with make_client(tiny_ckpt, max_queued_tokens=40) as client:
        long = {**CHAT, "messages": [{"role": "user", "content": "word " * 60}]}
        resp = client.post(CHAT_PATH, json=long)
        assert_overloaded(resp)
        assert "queue of prompt tokens is full" in resp.json()["error"]["message"]
        assert client.post(CHAT_PATH, json=CHAT).status_code == 200
        assert client.app.state.engine.engine.admission.queued_tokens == 0


def test_queue_counts_never_leak(tiny_ckpt):
    """Every way a request can leave before the scheduler admits it takes it out of the counts once."""
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), num_kv_blocks=64, max_queued_requests=2))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def counts(ae: AsyncEngine) -> tuple[int, int]:
        return ae.engine.admission.queued_requests, ae.engine.admission.queued_tokens

    async def until(cond, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        prompt = engine.process_chat(user("hello there"))
        n = len(prompt.token_ids)
        try:
            # Served to the end.
            stream = await ae.add_request("ok", prompt, params)
            assert [o async for o in stream][-1].finished
            await until(lambda: counts(ae) == (0, 0))

            stall = StalledStep(engine)
            # Cancelled while waiting for the engine thread (a client gone before acceptance).
            first = await ae.add_request("first", prompt, params)  # accepted; its step stalls
            assert stall.entered.wait(WAIT_S) and counts(ae) == (1, n)
            task = asyncio.ensure_future(ae.add_request("cancelled", prompt, params))
            await asyncio.sleep(0)  # the task runs up to waiting for the engine thread (admitted by then)
            assert counts(ae) == (2, 2 * n)
            with pytest.raises(EngineOverloaded):  # the bound holds meanwhile, without waiting
                await ae.add_request("refused", prompt, params)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert counts(ae) == (1, n)
            # Accepted, then closed before the scheduler admitted it.
            first.close()
            assert counts(ae) == (0, 0)
            # Refused by the engine itself (too long for the context).
            stall.release.set()
            too_long = engine.process_chat(user("word " * engine.max_model_len))
            with pytest.raises(InputError):
                await ae.add_request("too-long", too_long, params)
            assert counts(ae) == (0, 0)

            # A step that fails before scheduling fails the queued request: counted out by its failure.
            real = stall.real

            def failing_step():
                engine.step = real
                raise RuntimeError("simulated fault")

            engine.step = failing_step
            stream = await ae.add_request("failed", prompt, params)
            with pytest.raises(EngineFailure):
                [o async for o in stream]
            assert counts(ae) == (0, 0)

            # Nothing leaked: the bound of 2 still admits 2.
            streams = [await ae.add_request(f"after{i}", prompt, params) for i in range(2)]
            for s in streams:
                assert [o async for o in s][-1].finished
            await until(lambda: counts(ae) == (0, 0))
        finally:
            await asyncio.to_thread(ae.shutdown)

    asyncio.run(main())


@pytest.mark.parametrize(
    "flags, expected",
    [
        ((), None),
        (("--visual-budget", "fixed", "--slo-admission"), True),
        (("--no-slo-admission",), False),
    ],
)
def test_serve_passes_slo_admission_to_the_engine(tiny_ckpt, monkeypatch, flags, expected):
    """`vlmserve serve --slo-admission / --no-slo-admission` reaches EngineConfig (None: the budget decides)."""
    import api.server
    import runtime.memory
    from api.cli import main
    from tests.support import free_port

    started: list[ServerArgs] = []
    monkeypatch.setattr(api.server, "run_server", lambda args, startup=None: started.append(args))
    monkeypatch.setattr(runtime.memory, "bound_native_caches", lambda: None)  # leave this process's env
    assert main(["serve", "--model", str(tiny_ckpt), "--port", str(free_port()), *flags]) == 0
    assert [s.engine.slo_admission for s in started] == [expected]
