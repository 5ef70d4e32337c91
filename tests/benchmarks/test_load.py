"""benchmarks/load.py against small fake OpenAI servers on 127.0.0.1: timings, errors, stalls, traces, goodput.

The fake servers speak just enough HTTP/1.1 (one request per connection) to misbehave on purpose: a
stall that never answers, a stream that stops or breaks midway, bad SSE. Nothing here leaves loopback.

No verdict depends on the machine's pace: timings are checked against lower bounds no machine can beat (a
chunk cannot arrive before the server sent it), stalls last until the test ends (so only the client's own
timeout or stop can end a request, which its error kind tells), and WAIT_S bounds a run that would hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from benchmarks import load

Handler = Callable[[str, str, bytes, asyncio.StreamWriter], Awaitable[None]]
WAIT_S = 60.0  # a bound on a run that would otherwise hang, far past any machine's pace
EPS = 1e-3  # timer granularity: an asyncio sleep may end this much early, never more


class FakeServer:
    """An asyncio TCP server on 127.0.0.1: parses one request per connection and hands it to ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.bodies: list[dict] = []
        self.active = 0
        self.max_active = 0
        self._conns: set[asyncio.Task] = set()

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(asyncio.current_task())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if body:
                self.bodies.append(json.loads(body))
            await self.handler(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # NOTE: cancelled at shutdown; swallowed, or asyncio logs it as a handler failure
        finally:
            self.active -= 1
            writer.close()
            self._conns.discard(asyncio.current_task())


def _head(status: str, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status}"] + [f"{k}: {v}" for k, v in headers.items()] + ["Connection: close", "", ""]
    return "\r\n".join(lines).encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(obj: dict | str) -> bytes:
    return _chunk(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())


def _delta(text: str | None = None, finish: str | None = None, **extra) -> dict:
    delta = {} if text is None else {"content": text}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


async def _start_stream(writer: asyncio.StreamWriter, headers: dict[str, str] | None = None) -> None:
    sse = {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked", **(headers or {})}
    writer.write(_head("200 OK", sse))
    writer.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}))
    await writer.drain()


def streaming(first_s: float, gap_s: float, tokens: int, *, done: bool = True, usage: bool = True) -> Handler:
    """A well-behaved server: role chunk at once, the first token after ``first_s``, then one per ``gap_s``."""

    async def handler(method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path.endswith("/models"):
            payload = json.dumps({"object": "list", "data": [{"id": "fake-vlm", "object": "model"}]}).encode()
            writer.write(
                _head("200 OK", {"Content-Type": "application/json", "Content-Length": str(len(payload))})
            )
            writer.write(payload)
            return
        level = str(len(body) % 2)
        await _start_stream(
            writer, {"x-vlmserve-visual-level": level, "X-Visual-Budget-Levels": "0", "x-other": "no"}
        )
        await asyncio.sleep(first_s)
        for i in range(tokens):
            if i:
                await asyncio.sleep(gap_s)
            writer.write(_event(_delta(f"t{i} ")))
            await writer.drain()
        writer.write(_event(_delta(None, "length")))
        if usage:
            usage_body = {"prompt_tokens": 7, "completion_tokens": tokens, "visual_levels": [int(level)]}
            writer.write(_event({"choices": [], "usage": usage_body}))
        if done:
            writer.write(_event("[DONE]"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return handler


def _target(server: FakeServer, **kw) -> load.Target:
    return load.Target(server.base_url, "fake-vlm", **kw)


def _small_trace(n: int, **kw) -> tuple[load.Trace, load.ImageStore]:
    spec = load.TraceSpec(num_requests=n, seed=3, resolutions={"32x24": 1.0, "16x16": 1.0}, **kw)
    trace = load.make_trace(spec)
    images = load.ImageStore(trace)
    images.prepare(1)
    return trace, images


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))


async def _forever() -> None:
    """A stall: ends only when the fake server shuts down (cancelled) at the end of the test."""
    await asyncio.Event().wait()


# ---------------------------------------------------------------- (1) a well-behaved server


def test_timings_and_counts_against_a_streaming_server():
    async def main():
        async with FakeServer(streaming(0.05, 0.01, 20)) as srv:
            trace, images = _small_trace(8, max_tokens=(20, 20))
            res = await load.run_load(
                trace, images, _target(srv), load.LoadMode(concurrency=4, request_timeout_s=5)
            )
            return srv, res

    srv, res = _run(main())
    assert len(res.records) == 8 and all(r.ok for r in res.records), [r.error for r in res.records]
    assert srv.max_active <= 4
    s = load.summarize(res.records, duration_s=res.duration_s)
    assert s["ok"] == 8 and s["failed"] == 0 and s["output_tokens"]["total"] == 160
    # Each content chunk is stamped when it arrived, never before the server sent it (50 ms, then one per
    # 10 ms, after the request): in particular the role-only first chunk, sent at once, is not a token.
    for r in res.records:
        assert len(r.chunk_times_s) == 20, r.chunk_times_s
        assert all(t >= 0.05 + 0.01 * k - EPS for k, t in enumerate(r.chunk_times_s)), r.chunk_times_s
        assert r.e2e_s >= r.chunk_times_s[-1]
        assert r.text == "".join(f"t{k} " for k in range(20))  # the reply, for scoring answers
    assert s["ttft_ms"]["p50"] == pytest.approx(1e3 * np.median([r.chunk_times_s[0] for r in res.records]))
    assert s["tpot_ms"]["n"] == 8 and s["itl_ms"]["n"] == 8 * 19
    # two waves of four requests, each at least 50 + 19·10 ms
    assert res.duration_s >= 2 * (0.05 + 19 * 0.01) - EPS
    assert set(s["headers"]) == {"x-vlmserve-visual-level", "x-visual-budget-levels"}  # not x-other
    assert sum(s["headers"]["x-vlmserve-visual-level"].values()) == 8
    assert s["headers"]["x-visual-budget-levels"] == {"0": 8}
    assert {k: s["headers"]["x-vlmserve-visual-level"].get(k, 0) for k in "01"} == {
        k: s["visual_levels"].get(k, 0) for k in "01"
    }
    body = srv.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 20 and body["model"] == "fake-vlm"
    assert body["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/")


def test_poisson_pacing_follows_the_trace_and_model_discovery():
    async def main():
        async with FakeServer(streaming(0.0, 0.0, 3, done=False, usage=False)) as srv:
            model = await load.discover_model(srv.base_url)
            trace, images = _small_trace(10)
            target = load.Target(srv.base_url, model, ignore_eos=True)
            res = await load.run_load(trace, images, target, load.LoadMode(rate=40.0, request_timeout_s=5))
            return model, srv, trace, res

    model, srv, trace, res = _run(main())
    assert model == "fake-vlm"
    # no [DONE] and no usage (like `transformers serve`): complete by finish_reason, tokens counted from chunks
    assert all(r.ok and r.output_tokens == 3 for r in res.records)
    for rec, req in zip(res.records, trace.requests):
        assert rec.scheduled_s == pytest.approx(req.t_unit / 40.0)
        assert rec.start_s >= rec.scheduled_s  # paced: none starts before its time in the trace
    assert all(b["ignore_eos"] is True for b in srv.bodies)


# ---------------------------------------------------------------- (2) errors


def test_500_and_503_are_counted_by_status():
    async def handler(method, path, body, writer):
        n = len(handler.seen)
        handler.seen.append(n)
        if n % 2:
            payload = json.dumps({"error": {"message": "overloaded", "type": "server_error", "code": 503}})
            status, extra = "503 Service Unavailable", {"Retry-After": "2", "x-vlmserve-queue": "full"}
        else:
            payload, status, extra = "boom", "500 Internal Server Error", {}
        data = payload.encode()
        writer.write(
            _head(status, {"Content-Type": "application/json", "Content-Length": str(len(data)), **extra})
        )
        writer.write(data)

    handler.seen = []

    async def main():
        async with FakeServer(handler) as srv:
            trace, images = _small_trace(10)
            return await load.run_load(
                trace, images, _target(srv), load.LoadMode(concurrency=3, request_timeout_s=5)
            )

    res = _run(main())
    s = load.summarize(res.records, duration_s=res.duration_s, slo_ttft_ms=1000)
    assert s["sent"] == 10 and s["ok"] == 0 and s["goodput"] == 0
    assert set(s["errors"]) == {"http 500", "http 503"}
    assert s["errors"]["http 500"]["count"] == 5 and s["errors"]["http 500"]["example"] == "boom"
    e503 = s["errors"]["http 503"]
    assert e503["count"] == 5 and e503["retry_after"] == {"2": 5} and e503["example"] == "overloaded"
    assert e503["latency_ms"]["n"] == 5


def test_malformed_sse_and_stream_errors_are_reported():
    async def handler(method, path, body, writer):
        await _start_stream(writer)
        if len(handler.seen) % 2:
            writer.write(_event("{not json"))
        else:
            writer.write(_event({"error": "CUDA out of memory"}))  # `transformers serve`'s error event
        handler.seen.append(1)
        await writer.drain()
        await _forever()  # the client must not wait for the end (waiting, it would end by its timeout)

    handler.seen = []

    async def main():
        async with FakeServer(handler) as srv:
            trace, images = _small_trace(4)
            return await load.run_load(
                trace, images, _target(srv), load.LoadMode(concurrency=1, request_timeout_s=WAIT_S / 8)
            )

    res = _run(main())
    kinds = sorted(r.error_kind for r in res.records)
    assert kinds == ["malformed", "malformed", "stream_error", "stream_error"]
    assert any(r.error == "CUDA out of memory" for r in res.records)


# ---------------------------------------------------------------- (3) stalls and broken streams


def test_stalls_and_broken_streams_end_within_the_timeout():
    async def never(method, path, body, writer):
        await _forever()

    async def stops_midstream(method, path, body, writer):
        await _start_stream(writer)
        for i in range(3):
            writer.write(_event(_delta(f"t{i}")))
        await writer.drain()
        await _forever()

    async def closes_midstream(method, path, body, writer):
        await _start_stream(writer)
        for i in range(3):
            writer.write(_event(_delta(f"t{i}")))
        await writer.drain()  # then the connection closes with the chunked body unfinished

    async def ends_early(method, path, body, writer):
        await _start_stream(writer)
        writer.write(_event(_delta("t0")) + b"0\r\n\r\n")  # a clean end, but no finish_reason nor [DONE]

    async def main():
        out = {}
        for name, handler in [
            ("never", never),
            ("stops", stops_midstream),
            ("closes", closes_midstream),
            ("ends", ends_early),
        ]:
            async with FakeServer(handler) as srv:
                trace, images = _small_trace(4)
                mode = load.LoadMode(concurrency=4, request_timeout_s=0.4)
                out[name] = await load.run_load(trace, images, _target(srv), mode)
        return out

    out = _run(main())  # the stalls never end: only the client's timeout ends these runs within WAIT_S
    for name, res in out.items():
        assert len(res.records) == 4 and not any(r.ok for r in res.records), name
    stalled, stops, closes, ends = (out[k].records for k in ("never", "stops", "closes", "ends"))
    assert {r.error_kind for r in stalled} == {"timeout"} and all(r.status is None for r in stalled)
    assert all("no response headers" in r.error for r in stalled)
    assert {r.error_kind for r in stops} == {"timeout"} and all(
        "mid-stream after 3" in r.error for r in stops
    )
    assert all(r.e2e_s >= 0.4 - EPS for r in stalled + stops)  # not before the timeout
    assert {r.error_kind for r in closes} == {"incomplete"} and all(len(r.chunk_times_s) == 3 for r in closes)
    assert {r.error_kind for r in ends} == {"incomplete"}
    s = load.summarize(stops)
    assert s["errors"]["timeout 200"]["count"] == 4 and s["ttft_ms"]["n"] == 0


def test_duration_cap_and_stop_event_bound_the_run():
    async def main():
        async with FakeServer(lambda *args: _forever()) as srv:
            trace, images = _small_trace(50)
            # duration: nothing starts after 0.5 s; in-flight requests end by their 0.3 s timeout
            capped = await load.run_load(
                trace, images, _target(srv), load.LoadMode(rate=20.0, duration_s=0.5, request_timeout_s=0.3)
            )
            # stop (what Ctrl-C sets): in-flight requests are cancelled and recorded as such (their timeout is
            # far off, and the server never answers)
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.2, stop.set)
            stopped = await load.run_load(
                trace, images, _target(srv), load.LoadMode(concurrency=2, request_timeout_s=WAIT_S), stop=stop
            )
            return trace, capped, stopped

    trace, capped, stopped = _run(main())
    on_time = [i for i, r in enumerate(trace.requests) if r.t_unit / 20.0 <= 0.5]
    assert 1 <= len(capped.records) <= len(on_time) < len(trace.requests)
    assert [r.index for r in capped.records] == on_time[: len(capped.records)]  # in order, none after the cap
    assert all(r.error_kind == "timeout" for r in capped.records)
    assert stopped.interrupted
    assert len(stopped.records) == 2 and {r.error_kind for r in stopped.records} == {"cancelled"}
    assert load.summarize(stopped.records, planned=stopped.planned)["planned"] == 50


def test_request_bodies_per_dialect():
    """The body is valid JSON with the image URLs intact; `transformers serve` gets its own fields."""
    trace, images = _small_trace(6, images_per_request={"2": 1.0}, detail={"low": 1.0})
    req = trace.requests[0]
    body = json.loads(
        load.build_body(req, images, load.Target("http://127.0.0.1:1/v1", "m", ignore_eos=True))
    )
    parts = body["messages"][0]["content"]
    assert [p["image_url"]["url"].encode() for p in parts[:2]] == [images.urls[i] for i in req.images]
    assert parts[0]["image_url"]["detail"] == "low" and parts[2] == {"type": "text", "text": req.prompt}
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    hf = load.Target(
        "http://127.0.0.1:1/v1", "m", ignore_eos=True, dialect="transformers", extra_body={"seed": 1}
    )
    body = json.loads(load.build_body(req, images, hf))
    assert "stream_options" not in body and "ignore_eos" not in body and body["seed"] == 1
    assert json.loads(body["generation_config"]) == {"max_new_tokens": 128, "min_new_tokens": 128}


def test_non_loopback_targets_are_refused():
    for url in ("http://10.1.2.3:8000/v1", "http://example.com/v1", "https://[2001:db8::1]/v1"):
        with pytest.raises(ValueError, match="non-loopback"):
            load.check_loopback(url)
    for url in (
        "http://127.0.0.1:8000/v1",
        "http://localhost:1/v1",
        "http://[::1]:8000/v1",
        "http://127.0.0.2/",
    ):
        load.check_loopback(url)
    load.check_loopback("http://10.1.2.3:8000/v1", allow_remote=True)
    with pytest.raises(ValueError, match="non-loopback"):
        _run(load.discover_model("http://192.0.2.1:8000/v1"))
    assert load.main(["--base-url", "http://192.0.2.1:8000/v1", "--concurrency", "1"]) == 2


# ---------------------------------------------------------------- (4) traces


def test_trace_is_deterministic_and_round_trips(tmp_path):
    spec = load.TraceSpec(
        num_requests=40,
        seed=7,
        resolutions={"64x48": 2.0, "40x40": 1.0},
        images_per_request={"0": 1.0, "1": 2.0, "2": 1.0},
        repeat_share=0.4,
        detail={"auto": 1.0, "none": 1.0},
        max_tokens=(8, 64),
        prompt_words=(0, 20),
    )
    a, b = load.make_trace(spec), load.make_trace(spec)
    assert a == b and a.digest() == b.digest()
    other = load.make_trace(dataclasses.replace(spec, seed=8))
    assert other.digest() != a.digest()
    assert len(a.images) < sum(len(r.images) for r in a.requests)  # some slots reuse earlier images
    assert {r.detail for r in a.requests} == {"auto", None}
    assert all(8 <= r.max_tokens <= 64 for r in a.requests)
    assert [r.t_unit for r in a.requests] == sorted(r.t_unit for r in a.requests) and a.requests[
        0
    ].t_unit == 0

    store = load.ImageStore(a)
    store.prepare(2)
    again = load.ImageStore(load.make_trace(spec))
    again.prepare(1)
    assert store.urls == again.urls  # pixels and encodings are seeded too

    path = tmp_path / "trace.json"
    load.save_trace(a, path)
    loaded = load.load_trace(path)
    assert loaded.digest() == a.digest() and loaded.requests == a.requests and loaded.images == a.images
    assert loaded.image_sha256 == a.image_sha256 and len(loaded.image_sha256) == len(a.images)
    replay = load.ImageStore(loaded)
    replay.prepare(1)
    assert replay.mismatched == [] and replay.urls == store.urls

    sib = load.sibling_trace(loaded, 2)
    assert sib.spec == {**a.spec, "seed": 9} and len(sib.requests) == 40 and sib.digest() != a.digest()
    assert sib.digest() == load.sibling_trace(a, 2).digest()

    head = loaded.head(5)
    assert head.requests == a.requests[:5]
    assert {i.id for i in head.images} == {i for r in head.requests for i in r.images}


def test_cli_end_to_end_with_sweep_json_and_plots(tmp_path, capsys):
    """The CLI: model discovery, a two-rate sweep on one trace, the table, JSON and PNGs."""

    async def main(argv):
        async with FakeServer(streaming(0.02, 0.005, 4)) as srv:
            return await load.amain(load.parse_args(["--base-url", srv.base_url, *argv]))

    trace_file = tmp_path / "t.json"
    # SLOs no machine misses against this server: what is checked is that they reach the summary
    argv = ["-n", "6", "--resolutions", "48x32", "--rates", "50,100"]
    argv += ["--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"]
    argv += ["--out", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path / "plots")]
    argv += ["--save-trace", str(trace_file), "--warmup", "1", "--progress-s", "0"]
    out = _run(main(argv))
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "goodput" in printed and "rate 100/s" in printed
    saved = json.loads((tmp_path / "r.json").read_text())
    assert len(saved["runs"]) == 2 and saved["trace"]["digest"] == load.load_trace(trace_file).digest()
    # the second rate runs the sibling trace (seed + 1), so the first rate's requests leave no warm cache
    sibling = load.sibling_trace(load.load_trace(trace_file), 1)
    assert [r["trace_digest"] for r in saved["runs"]] == [saved["trace"]["digest"], sibling.digest()]
    for run in saved["runs"]:
        assert run["summary"]["ok"] == 6 and run["summary"]["slo"]["met"] == 6
        assert len(run["records"]) == 6 and run["records"][0]["output_tokens"] == 4
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "e2e_cdf.png",
        "goodput_vs_rate.png",
        "ttft_cdf.png",
    ]
    assert out["target"]["model"] == "fake-vlm"


# ---------------------------------------------------------------- (5) goodput


def _rec(i: int, ttft: float | None, e2e: float, tokens: int, status: int = 200, kind: str | None = None):
    times = (
        []
        if ttft is None
        else [ttft] + [ttft + (e2e - ttft) * k / max(1, tokens - 1) for k in range(1, tokens)]
    )
    rec = load.RequestRecord(i, start_s=float(i), status=status, chunk_times_s=times, e2e_s=e2e)
    rec.usage = {"completion_tokens": tokens, "prompt_tokens": 100}
    rec.error_kind = kind
    return rec


def test_goodput_against_hand_computed_oracle():
    records = [
        _rec(0, 0.100, 1.090, 100),  # TTFT 100 ms, TPOT 990/99 = 10 ms: meets both
        _rec(1, 0.300, 0.300 + 99 * 0.020, 100),  # TTFT 300 ms: misses TTFT (250 ms)
        _rec(2, 0.200, 0.200 + 9 * 0.040, 10),  # TPOT 40 ms: misses TPOT (31.25 ms)
        _rec(3, 0.250, 1.250, 33),  # TTFT 250 ms, TPOT 1000/32 = 31.25 ms: exactly on both limits, meets
        _rec(4, 0.050, 0.050, 1),  # one token: no TPOT; TTFT 50 ms: meets
        _rec(5, None, 0.500, 0, status=503, kind="http"),  # refused: never good
        _rec(6, 0.010, 0.5, 20, kind="timeout"),  # fast but failed: never good
    ]
    s = load.summarize(records, duration_s=4.0, slo_ttft_ms=250, slo_tpot_ms=31.25)
    assert s["ok"] == 5 and s["failed"] == 2 and s["sent"] == 7
    assert s["slo"]["met"] == 3 and s["goodput"] == pytest.approx(3 / 4.0)
    assert s["request_throughput"] == pytest.approx(5 / 4.0)
    assert s["output_token_throughput"] == pytest.approx((100 + 100 + 10 + 33 + 1) / 4.0)
    assert s["tpot_ms"]["n"] == 4 and s["tpot_ms"]["p50"] == pytest.approx((20 + 31.25) / 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    # only one SLO: the other is not applied
    assert load.summarize(records, duration_s=4.0, slo_ttft_ms=250)["slo"]["met"] == 4
    assert load.summarize(records, duration_s=4.0, slo_tpot_ms=31.25)["slo"]["met"] == 4
    assert load.summarize(records, duration_s=4.0)["goodput"] is None
    # default duration: from the run's start to the last end (record 6 starts at 6 s, lasts 0.5 s)
    assert load.summarize(records)["duration_s"] == pytest.approx(6.5)
