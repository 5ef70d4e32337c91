"""L1: an in-process LRU of embeddings, bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from cache.key import EmbeddingKey
from cache.tier import EmbeddingTier


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    # NOTE: a per-image slice of a batched encoder output shares the whole batch's storage;
    # caching the view would pin that storage while the byte accounting sees only the slice.
    t = tensor.detach()
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class MemoryTier(EmbeddingTier):
    """Thread-safe LRU holding at most `capacity_bytes` of tensor data (tensor.nbytes).

    A value larger than the whole capacity is not stored. Returned tensors are the stored ones
    (no copy): treat them as read-only.
    """

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[EmbeddingKey, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.rejected = 0  # puts larger than the whole capacity

    def get(self, key: EmbeddingKey) -> torch.Tensor | None:
        with self._lock:
            tensor = self._entries.get(key)
            if tensor is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return tensor

    def contains(self, key: EmbeddingKey) -> bool:
        """Existence check that neither counts a hit/miss nor refreshes recency."""
        with self._lock:
            return key in self._entries

    def put(self, key: EmbeddingKey, tensor: torch.Tensor) -> None:
        value = _owned(tensor)
        size = value.nbytes
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if size > self.capacity_bytes:
                self.rejected += 1
                return
            while self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = value
            self._bytes += size

    def lru_order(self) -> list[EmbeddingKey]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "rejected": self.rejected,
                "entries": len(self._entries),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity_bytes,
            }
