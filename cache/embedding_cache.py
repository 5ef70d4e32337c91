"""The embedding cache the encoder consults: L1 memory, optional L2 Redis shared by replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cache.key import EmbeddingKey
from cache.layout import Check
from cache.memory import MemoryTier
from cache.redis_tier import RedisTier
from cache.tier import EmbeddingTier


class EmbeddingCache:
    """get: L1, then L2 (an L2 hit is promoted into L1). put: both tiers.

    Thread-safe; never raises because Redis misbehaves (see EmbeddingTier). Returned tensors are
    shared with the cache: read them, do not modify them in place. A reader passes its ``check``
    (``EmbeddingLayout.problem``): an entry that does not fit its key is a miss, dropped from its tier.
    """

    def __init__(self, l1: MemoryTier, l2: EmbeddingTier | None = None) -> None:
        self.l1 = l1
        self.l2 = l2

    @classmethod
    def create(cls, memory_bytes: int, redis_url: str | None = None, **redis_options: Any) -> EmbeddingCache:
        """`redis_options` are RedisTier keyword arguments (prefix, ttl_s, timeout_s, ...)."""
        l2 = RedisTier(redis_url, **redis_options) if redis_url else None
        return cls(MemoryTier(memory_bytes), l2)

    def contains(self, key: EmbeddingKey) -> bool:
        """L1-only existence check; counts nothing and does not refresh recency."""
        return self.l1.contains(key)

    def get(self, key: EmbeddingKey, check: Check | None = None) -> torch.Tensor | None:
        return self.get_many([key], check)[0]

    def get_many(self, keys: Sequence[EmbeddingKey], check: Check | None = None) -> list[torch.Tensor | None]:
        found = [self.l1.get(k, check) for k in keys]
        missing = [i for i, t in enumerate(found) if t is None]
        if self.l2 is None or not missing:
            return found
        # One L2 round trip for all L1 misses of the batch.
        for i, tensor in zip(missing, self.l2.get_many([keys[i] for i in missing], check), strict=True):
            if tensor is not None:
                self.l1.put(keys[i], tensor)
                found[i] = tensor
        return found

    def put(self, key: EmbeddingKey, tensor: torch.Tensor) -> None:
        self.l1.put(key, tensor)
        if self.l2 is not None:
            self.l2.put(key, tensor)

    def stats(self) -> dict[str, dict[str, int | float | str]]:
        """{"memory": {...}, "redis": {...}} (the latter only with an L2): plain snapshots."""
        snap = {self.l1.name: self.l1.stats()}
        if self.l2 is not None:
            snap[self.l2.name] = self.l2.stats()
        return snap

    def close(self) -> None:
        if self.l2 is not None:
            self.l2.close()

    def __enter__(self) -> EmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
