"""L2: embeddings shared between replicas through Redis.

Redis is an optimisation, never a dependency: every failure becomes a miss, a circuit breaker
stops paying timeouts while it is down, and puts go through a small background writer so a slow
server never blocks the request path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache import codec
from cache.breaker import BreakerState, CircuitBreaker
from cache.key import EmbeddingKey
from cache.layout import Check
from cache.tier import EmbeddingTier

log = logging.getLogger(__name__)

_BACKEND_ERRORS = (redis.RedisError, OSError)


class RedisTier(EmbeddingTier):
    """Values are `codec` entries under `{prefix}emb:{key.digest()}`, written with SET EX ttl_s.

    Time bounds: a get costs at most about `timeout_s` (+ `connect_timeout_s` on a new
    connection); after `failure_threshold` consecutive failures the breaker opens and gets return
    None at once for `cooldown_s`, then one trial call decides whether Redis is back.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "vlmserve:",
        ttl_s: int | None = 24 * 3600,
        connect_timeout_s: float = 0.1,
        timeout_s: float = 0.1,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        async_puts: bool = True,
        max_pending_puts: int = 256,
        max_value_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.max_pending_puts = max_pending_puts
        # NOTE: redis-py retries ConnectionError/TimeoutError 10 times with backoff by default,
        # which turns a 100 ms timeout into seconds; the breaker is our retry policy instead.
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        kw = self._client.connection_pool.connection_kwargs
        self._where = f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}/{kw.get('db', 0)}"
        self.breaker = CircuitBreaker(
            failure_threshold, cooldown_s, clock=clock, on_transition=self._log_transition
        )
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "errors", "corrupt", "invalid", "short_circuited", "puts", "dropped_puts"), 0
        )
        self._async = async_puts
        self._pending: deque[tuple[str, torch.Tensor, int]] = deque()
        self._inflight = 0
        self._closing = False
        self._cv = threading.Condition()
        self._writer: threading.Thread | None = None
        if async_puts:
            self._writer = threading.Thread(target=self._write_loop, name="redis-emb-writer", daemon=True)
            self._writer.start()

    def redis_key(self, key: EmbeddingKey) -> str:
        return self._redis_key(key.digest())

    def _redis_key(self, digest: str) -> str:
        return f"{self.prefix}emb:{digest}"

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: EmbeddingKey, check: Check | None = None) -> torch.Tensor | None:
        return self.get_many([key], check)[0]

    def get_many(self, keys: Sequence[EmbeddingKey], check: Check | None = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        names = [self.redis_key(k) for k in keys]
        ok, raw = self._call(self._client.mget, names)
        if not ok:
            self._count(misses=len(keys))
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        bad: list[str] = []
        for key, name, data in zip(keys, names, raw, strict=True):
            tensor = self._decode(key, name, data, check)
            if tensor is None and data is not None:
                bad.append(name)
            out.append(tensor)
        if bad:
            # NOTE: a good entry written between the read and this delete is lost too: that costs one
            # encode, where keeping the bad one would fail every reader until its TTL.
            self._call(self._client.delete, *bad)
        return out

    def _decode(
        self, key: EmbeddingKey, name: str, data: bytes | None, check: Check | None
    ) -> torch.Tensor | None:
        if data is None:
            self._count(misses=1)
            return None
        try:
            tensor = codec.decode(key.digest(), data, key.levels)
        except codec.CorruptEntry as e:
            log.warning("deleting corrupt embedding entry %s: %s", name, e)
            self._count(misses=1, corrupt=1, invalid=1)
            return None
        why = check(key, tensor) if check is not None else None
        if why is not None:
            log.warning("deleting embedding entry %s that does not fit its key: %s", name, why)
            self._count(misses=1, invalid=1)
            return None
        self._count(hits=1)
        return tensor

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: EmbeddingKey, tensor: torch.Tensor) -> None:
        if tensor.dtype not in codec.ALLOWED_DTYPES.values():
            raise TypeError(f"dtype {tensor.dtype} is not storable in Redis")
        # NOTE: not `state is OPEN`: after the cool-down a put must reach the writer so that a
        # put-only workload (batch mode, all new images) also runs the half-open trial.
        if tensor.nbytes > self.max_value_bytes or self.breaker.rejecting():
            self._count(dropped_puts=1)
            return
        digest = key.digest()
        if not self._async:
            self._write(digest, tensor, key.levels)
            return
        with self._cv:
            if self._closing or len(self._pending) >= self.max_pending_puts:
                self._count(dropped_puts=1)
                return
            self._pending.append((digest, tensor.detach(), key.levels))
            self._cv.notify()

    def store(self, key: EmbeddingKey, tensor: torch.Tensor) -> bool:
        """A put made now, in the caller's thread, that says whether Redis holds the value: for a caller
        that tells a reader elsewhere to fetch it (the encoder tier). Bounded like a get; never raises
        because Redis is down."""
        if tensor.dtype not in codec.ALLOWED_DTYPES.values():
            raise TypeError(f"dtype {tensor.dtype} is not storable in Redis")
        if tensor.nbytes > self.max_value_bytes or self.breaker.rejecting():
            self._count(dropped_puts=1)
            return False
        return self._write(key.digest(), tensor, key.levels)

    def _write(self, digest: str, tensor: torch.Tensor, levels: int = 0) -> bool:
        # Encoding happens here (the writer thread when async): it copies the tensor to host bytes.
        value = codec.encode(digest, tensor, levels)
        ok, _ = self._call(self._client.set, self._redis_key(digest), value, ex=self.ttl_s)
        self._count(**({"puts": 1} if ok else {"dropped_puts": 1}))
        return ok

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if not self._pending:
                    return
                digest, tensor, levels = self._pending.popleft()
                self._inflight += 1
            try:
                self._write(digest, tensor, levels)
            except Exception:  # keep the writer alive whatever one value does
                log.exception("embedding write to Redis failed")
            finally:
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued puts are written or dropped; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._inflight, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Drain queued puts (bounded by timeout_s), stop the writer, close connections."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(timeout_s)
        with self._cv:
            self._count(dropped_puts=len(self._pending))
            self._pending.clear()
        self._client.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[bool, object]:
        if not self.breaker.allow():
            self._count(short_circuited=1)
            return False, None
        try:
            result = fn(*args, **kwargs)
        except _BACKEND_ERRORS as e:
            self.breaker.record_failure()
            self._count(errors=1)
            log.debug("redis %s: %r", self._where, e)
            return False, None
        except BaseException:
            self.breaker.record_failure()  # every allowed call reports an outcome
            raise
        self.breaker.record_success()
        return True, result

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, n in deltas.items():
                self._counts[name] += n

    def _log_transition(self, old: BreakerState, new: BreakerState) -> None:
        if new is BreakerState.OPEN:
            log.warning("redis embedding cache at %s unavailable; pausing it (%s -> open)", self._where, old)
        elif new is BreakerState.CLOSED:
            log.info("redis embedding cache at %s reachable again", self._where)

    def stats(self) -> dict[str, int | float | str]:
        with self._stats_lock:
            snap: dict[str, int | float | str] = dict(self._counts)
        with self._cv:
            snap["pending_puts"] = len(self._pending) + self._inflight
        snap["breaker_state"] = str(self.breaker.state)
        snap["breaker_opens"] = self.breaker.opens
        return snap
