"""Fixtures for the embedding-cache tests: the real Redis, and local sockets that misbehave."""

from __future__ import annotations

import itertools
import socket
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache import EmbeddingKey, RedisTier
from tests.support import RedisProxy, free_port, skip_or_fail

# NOTE: only ever 127.0.0.1; db 13 keeps test keys away from anything else using this server.
REDIS_HOST, REDIS_PORT, REDIS_DB = "127.0.0.1", 6379, 13
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"
RUN_PREFIX = f"vlmserve-test-{uuid.uuid4().hex}:"

_redis_problem: list[str | None] = []  # memoised once per session


def redis_problem() -> str | None:
    if not _redis_problem:
        try:
            client = redis.Redis(
                REDIS_HOST,
                REDIS_PORT,
                db=REDIS_DB,
                socket_timeout=1,
                socket_connect_timeout=1,
                retry=Retry(NoBackoff(), 0),  # redis-py would otherwise retry for seconds
            )
            client.ping()
            client.close()
            _redis_problem.append(None)
        except (redis.RedisError, OSError) as e:
            _redis_problem.append(f"Redis at {REDIS_HOST}:{REDIS_PORT} did not answer: {e!r}")
    return _redis_problem[0]


@pytest.fixture(autouse=True)
def _require_redis(request: pytest.FixtureRequest) -> None:
    """Tests marked `redis` skip without a server locally, but fail on CI, where it must exist."""
    if request.node.get_closest_marker("redis") is None:
        return
    problem = redis_problem()
    if problem is not None:
        skip_or_fail(f"{problem}; start redis-server on 127.0.0.1:6379 to run this test")


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    names = list(client.scan_iter(match=f"{prefix}*", count=500))
    return client.delete(*names) if names else 0


@pytest.fixture(scope="session", autouse=True)
def _cleanup_run_prefix() -> Iterator[None]:
    yield
    if redis_problem() is None:
        client = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB, socket_timeout=2)
        delete_prefix(client, RUN_PREFIX)
        client.close()


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis(REDIS_HOST, REDIS_PORT, db=REDIS_DB, socket_timeout=2)
    yield client
    client.close()


_test_ids = itertools.count()


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test alone; its keys are deleted afterwards."""
    p = f"{RUN_PREFIX}{next(_test_ids)}:"
    yield p
    delete_prefix(redis_client, p)


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    """RedisTier factory (defaults: the test Redis, short timeouts); tiers are closed afterwards."""
    tiers: list[RedisTier] = []

    def make(url: str = REDIS_URL, **kw: object) -> RedisTier:
        kw.setdefault("timeout_s", 0.05)
        kw.setdefault("connect_timeout_s", 0.05)
        tier = RedisTier(url, **kw)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close(timeout_s=1.0)


def _make_key(i: int, *, grid: tuple[int, int, int] = (1, 4, 6), model: str = "model-a") -> EmbeddingKey:
    return EmbeddingKey(f"{i:032x}", grid, "pre-v1", model)


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infs, subnormals included) of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


# Helpers are handed out as fixtures: `from conftest import ...` breaks once several test
# folders have a conftest.py.
@pytest.fixture
def make_key() -> Callable[..., EmbeddingKey]:
    return _make_key


@pytest.fixture
def random_bits() -> Callable[..., torch.Tensor]:
    return _random_bits


@pytest.fixture
def same_bits() -> Callable[[torch.Tensor, torch.Tensor], bool]:
    return _same_bits


@pytest.fixture
def refused_port() -> int:
    """A 127.0.0.1 port nothing listens on (connections are refused at once)."""
    return free_port()


class BlackHole:
    """A port that completes TCP handshakes but never reads or answers: a hung server. It counts the
    connections made to it (each attempt a client makes, retries included)."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0), backlog=64)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self._held: list[socket.socket] = []

    def connections(self) -> int:
        """Connections made so far: a client's connect() returns once the handshake is done, so every one of
        them is in the accept queue by then (taken here, held open, never read)."""
        while True:
            try:
                conn, _ = self._server.accept()
            except BlockingIOError:
                return len(self._held)
            self._held.append(conn)

    def close(self) -> None:
        self._server.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    hole = BlackHole()
    yield hole
    hole.close()


@pytest.fixture
def redis_proxy() -> Iterator[RedisProxy]:
    proxy = RedisProxy((REDIS_HOST, REDIS_PORT))
    yield proxy
    proxy.close()
