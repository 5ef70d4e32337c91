"""Fixtures for `vlmserve cluster`: HAProxy (required on CI), stand-in replicas whose pace the tests
control, the balancer in front of them, and the real Redis with a test-only DB and key prefix."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from api.cluster.haproxy import AdminSocket, BalancerConfig, HAProxyMissing, find_haproxy
from api.cluster.launcher import Cluster, ClusterSpec
from tests.support import QuietHandler, free_port, redis_client, skip_or_fail

# NOTE: loopback only; db 12 is the cluster tests' own, and every key they write starts with REDIS_PREFIX.
REDIS_URL = "redis://127.0.0.1:6379/12"
REDIS_PREFIX = f"vlmserve-test-cluster-{uuid.uuid4().hex[:12]}:"
HOLD = "x-test-hold"  # a stand-in replica keeps such a request open until the test releases it


@pytest.fixture(scope="session")
def haproxy_bin() -> str:
    try:
        return find_haproxy()
    except HAProxyMissing as exc:
        skip_or_fail(str(exc))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    client = redis_client(REDIS_URL, timeout_s=2)
    yield REDIS_URL
    keys = list(client.scan_iter(match=f"{REDIS_PREFIX}*", count=500))
    if keys:
        client.delete(*keys)
    client.close()


# ---------------------------------------------------------------- stand-in replicas


@dataclass
class Seen:
    rid: str
    size: int
    sha256: str


class StubReplica:
    """An HTTP server on a fixed loopback port that answers like a replica: /health 200, POST → JSON naming
    itself in x-vlmserve-replica. Requests with the HOLD header wait for ``release``. ``die`` closes the
    listener and every connection, as a killed process's kernel does; ``start`` brings it back on the same port."""

    def __init__(self, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.seen: list[Seen] = []
        self.held = 0
        self.release = threading.Event()
        self._conns: list[socket.socket] = []
        self._httpd: ThreadingHTTPServer | None = None
        self.start()

    def start(self) -> None:
        owner = self

        class Handler(QuietHandler):
            def setup(self) -> None:
                super().setup()
                owner._conns.append(self.connection)

            def _reply(self, status: int, body: bytes) -> None:
                self.send_body(status, body, "application/json", [("x-vlmserve-replica", owner.name)])

            def do_GET(self) -> None:
                self._reply(200, b'{"status": "ok"}')

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                seen = Seen(self.headers.get("x-request-id", ""), len(data), hashlib.sha256(data).hexdigest())
                owner.seen.append(seen)
                if self.headers.get(HOLD):
                    owner.held += 1
                    owner.release.wait(60)
                with contextlib.suppress(OSError):
                    self._reply(200, json.dumps({"replica": owner.name, "size": seen.size}).encode())

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request, client_address) -> None:
                pass  # connections the tests cut on purpose

        self._httpd = Server(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def die(self) -> None:
        assert self._httpd is not None
        self._httpd.shutdown()
        self._httpd.server_close()
        for conn in self._conns:
            # NOTE: close() would wait for the handler's file objects; shutdown() ends the connection now.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._conns.clear()
        self._httpd = None

    def close(self) -> None:
        self.release.set()
        if self._httpd is not None:
            self.die()


@dataclass
class StubCluster:
    """The balancer as `vlmserve cluster --replica-addr` runs it, in front of two stand-in replicas."""

    cluster: Cluster
    stubs: dict[str, StubReplica]
    url: str
    admin: AdminSocket
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def post(self, body: dict | bytes, **headers: str) -> httpx.Response:
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        if isinstance(body, dict):
            return self.http.post("/v1/chat/completions", json=body, headers=headers)
        return self.http.post(
            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json", **headers}
        )

    def log_line(self, rid: str) -> dict[str, str]:
        return balancer_log_line(self.cluster.run_dir / "haproxy.log", rid)

    def wait_load(self, total: int) -> dict[str, int]:
        """Per-replica requests in flight, once the balancer counts ``total`` of them."""
        deadline = time.monotonic() + 30
        while True:
            load = {n: s.current for n, s in self.admin.servers().items()}
            if sum(load.values()) == total or time.monotonic() > deadline:
                return load
            time.sleep(0.01)

    def session_for(self, replica: str) -> str:
        """An x-session-id the balancer sends to ``replica`` (found by asking it)."""
        for i in range(200):
            if (
                self.post(text_body("which?"), **{"x-session-id": f"s{i}"}).headers["x-vlmserve-replica"]
                == replica
            ):
                return f"s{i}"
        raise AssertionError(f"no session id among 200 maps to {replica}")


_LOG = re.compile(
    r"rid=(?P<rid>\S+) route=(?P<route>\S+) key=(?P<key>\S+) \S+/(?P<server>\S+) (?P<status>\d+) \d+ "
    r"(?P<timers>\S+) (?P<term>\S+) retries=(?P<retries>\S+)"
)


def balancer_log_line(path: Path, rid: str) -> dict[str, str]:
    """The balancer's log record of request ``rid`` (waits for HAProxy to write it)."""
    deadline = time.monotonic() + 10
    while True:
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG.search(line)
            if m and m["rid"] == rid:
                return m.groupdict()
        if time.monotonic() > deadline:
            raise AssertionError(f"no balancer log line for {rid}")
        time.sleep(0.05)


def text_body(text: str, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def image_body(url: str, question: str = "What is this?", **extra: object) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


@pytest.fixture
def stub_cluster(haproxy_bin: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StubCluster]:
    """Parametrize indirectly with a dict of BalancerConfig fields to change them (e.g. balance_min_load)."""
    stubs = {name: StubReplica(name) for name in ("r0", "r1")}
    port = free_port()
    spec = ClusterSpec(
        replicas=0,
        model="",
        port=port,
        remote=[f"127.0.0.1:{s.port}" for s in stubs.values()],
        run_dir=tmp_path / "run",
        balancer=BalancerConfig(
            bind="", replicas=[], admin_socket="", drain_timeout_s=30, **getattr(request, "param", {})
        ),
        startup_timeout_s=30,
    )
    cluster = Cluster(spec)
    cluster.start()
    sc = StubCluster(cluster, stubs, f"http://127.0.0.1:{port}", cluster.admin)
    yield sc
    for s in stubs.values():
        s.release.set()
    cluster.stop(drain=False)
    sc.http.close()
    for s in stubs.values():
        s.close()


@pytest.fixture
def wait_until() -> Callable[..., float]:
    """Poll ``cond`` until true (generous bound, so a slow machine only waits longer); returns the seconds."""

    def wait(cond: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition") -> float:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"{what} not reached in {timeout_s}s")
            time.sleep(0.01)
        return time.monotonic() - t0

    return wait
