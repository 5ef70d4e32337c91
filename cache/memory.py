"""L1: an in-process LRU of embeddings, bounded in bytes."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import torch

from cache.key import EmbeddingKey
from cache.layout import Check
from cache.tier import EmbeddingTier

# A CPU tensor's C++ side, which sys.getsizeof cannot see: TensorImpl and StorageImpl, 336 bytes, and its data
# block's 64-byte alignment and malloc header, at most 47 bytes above the data's size (glibc's mallinfo2 around
# 20,000 tensors, torch 2.14). tests/cache/test_memory_tier.py holds a full cache to its cap, tracemalloc and
# mallinfo2 measuring.
TENSOR_NATIVE_BYTES = 400


def _block(nbytes: int) -> int:
    # CPython's small-object allocator hands out blocks in multiples of 16 bytes.
    return -(-nbytes // 16) * 16


def entry_bytes(key: EmbeddingKey, tensor: torch.Tensor) -> int:
    """What an entry's own objects cost: the data, the tensor's objects and the key's (its slot in the
    table is charged by MemoryTier, as the table stands).

    NOTE: counts the key's strings as its own although keys of one model share their fingerprints: an
    overcount of about 130 bytes an entry, where an undercount would let many tiny entries pass the cap.
    """
    fields = (
        key,
        key.image_hash,
        key.grid,
        key.preprocess_fingerprint,
        key.model_fingerprint,
        key.cache_salt,
        key.raw,
    )
    big_ints = [g for g in key.grid if g > 256]  # CPython shares the small ones
    # NOTE: once made (as _owned does), the storage's Python object lives as long as the storage; its
    # getsizeof counts the data too.
    storage = tensor.untyped_storage()
    data = storage.nbytes()
    python_objects = _block(sys.getsizeof(tensor)) + _block(sys.getsizeof(storage) - data)
    python_objects += sum(_block(sys.getsizeof(obj)) for obj in (*fields, *big_ints))
    return data + TENSOR_NATIVE_BYTES + python_objects


_ONE_ENTRY_TABLE = sys.getsizeof(OrderedDict.fromkeys([0]))


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    # NOTE: a per-image slice of a batched encoder output shares the whole batch's storage;
    # caching the view would pin that storage while the byte accounting sees only the slice.
    t = tensor.detach()
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class MemoryTier(EmbeddingTier):
    """Thread-safe LRU holding at most `capacity_bytes`: each entry's `entry_bytes` (data, tensor and key
    objects) plus the OrderedDict itself as sys.getsizeof measures it (table, links), so that many small
    entries stay within the bound too.

    A value that would not fit in an otherwise empty tier is not stored. Returned tensors are the stored ones
    (no copy): treat them as read-only.
    """

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[EmbeddingKey, torch.Tensor] = OrderedDict()
        self._bytes = 0  # the entries' own bytes; the table's are read when needed
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.rejected = 0  # puts costing more than the whole capacity
        self.invalid = 0  # entries dropped on a get because they did not fit their key

    def get(self, key: EmbeddingKey, check: Check | None = None) -> torch.Tensor | None:
        with self._lock:
            tensor = self._entries.get(key)
            if tensor is not None and check is not None and check(key, tensor) is not None:
                del self._entries[key]
                self._bytes -= entry_bytes(key, tensor)
                self.invalid += 1
                tensor = None
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
        size = entry_bytes(key, value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                # NOTE: equal keys cost the same, so the old entry's cost is computed with this key.
                self._bytes -= entry_bytes(key, old)
            if size + _ONE_ENTRY_TABLE > self.capacity_bytes:
                self.rejected += 1
            else:
                self._entries[key] = value
                self._bytes += size
            # NOTE: only an insertion resizes the table (and setitem brings the OrderedDict's node index up
            # to date), so it is measured here; evicting frees the entries but never shrinks the table.
            while self._entries and self._bytes + sys.getsizeof(self._entries) > self.capacity_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                # Recomputed rather than stored: a stored cost would be one more object per entry.
                self._bytes -= entry_bytes(evicted_key, evicted)
                self.evictions += 1
            if not self._entries:
                self._entries.clear()  # drops a table sized for entries that are gone

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
                "invalid": self.invalid,
                "entries": len(self._entries),
                "bytes": self._bytes + sys.getsizeof(self._entries),
                "capacity_bytes": self.capacity_bytes,
            }
