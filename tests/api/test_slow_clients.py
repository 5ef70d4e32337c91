"""Slow and greedy clients at the socket, against a real server process: connections whose request does not
arrive in time are cut with a 408 while a normal client is served, and connections past the cap are refused at
once. Nothing here races the machine: a connection is never cut before its deadline (the server arms it when
the connection opens or the head ends), and the upper bounds are generous guards, not the verdict."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from tests.api.conftest import start_server

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
GUARD_S = 60.0  # a bound on waiting, far past any machine's pace


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_ckpt, image_server, canary):
    s = start_server(
        tmp_path_factory.mktemp("slow"), tiny_ckpt, image_server, canary,
        "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
    )  # fmt: skip
    yield s
    s.stop()


def connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GUARD_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def assert_timed_out(reply: bytes) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_slowloris_connections_are_cut_at_the_timeout_while_a_normal_client_is_served(guarded):
    started = time.monotonic()
    silent = connect(guarded)  # connects, sends nothing
    trickle = connect(guarded)  # a head that never ends
    trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    slow_body = connect(guarded)  # a whole head, then a body that stops short
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    slow_body.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10])
    )
    for _ in range(3):  # meanwhile a normal client is served, more than once
        resp = guarded.post_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    trickle.sendall(b"X-Slow: 1\r\n")  # more bytes of the head do not extend its deadline
    for sock, least in ((silent, HEADER_TIMEOUT_S), (trickle, HEADER_TIMEOUT_S), (slow_body, BODY_TIMEOUT_S)):
        assert_timed_out(read_until_closed(sock))
        assert time.monotonic() - started >= least  # never before its deadline
        sock.close()
    assert time.monotonic() - started < GUARD_S
    guarded.assert_alive()


def test_a_request_read_in_time_is_not_cut_while_it_is_answered(guarded):
    """The deadlines bound reading the request, not answering it: a streamed answer may outlast them."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    with guarded.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        time.sleep(BODY_TIMEOUT_S + HEADER_TIMEOUT_S)  # the connection outlives both deadlines
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in lines)


def test_connections_past_the_cap_are_refused_at_once(tmp_path_factory, tiny_ckpt, image_server, canary):
    cap = 6
    server = start_server(
        tmp_path_factory.mktemp("cap"), tiny_ckpt, image_server, canary,
        "--max-connections", str(cap), "--header-timeout", "600",
    )  # fmt: skip
    held: list[socket.socket] = []
    try:
        server.http.close()  # its kept-alive connection counts too, until the server sees it closed
        held = [connect(server) for _ in range(cap + 1)]
        # NOTE: connections are taken in the order they were made, and one past the cap is answered as it is
        # taken: once the last one has its answer, every earlier one was taken too.
        held[-1].settimeout(GUARD_S)
        refused = read_until_closed(held[-1])
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), refused
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        readable, _, _ = select.select(held[: cap - 1], [], [], 0)
        assert readable == []  # those within the cap are open and waiting for their request
        for sock in held:
            sock.close()
        held.clear()
        deadline = time.monotonic() + GUARD_S
        while True:  # the server sees the closes in its own time
            sock = connect(server)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            sock.settimeout(GUARD_S)
            reply = read_until_closed(sock)
            sock.close()
            if reply.startswith(b"HTTP/1.1 200"):
                break
            assert time.monotonic() < deadline, reply
    finally:
        for sock in held:
            sock.close()
        server.stop()
