"""The contract every embedding-cache tier keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from cache.key import EmbeddingKey
from cache.layout import Check


class EmbeddingTier(ABC):
    """One level of the embedding cache (in-process memory, Redis).

    Contract:
    - `get(key)` returns the tensor stored under `key` (same dtype, shape and bits as put) or None.
      A returned tensor may be shared with the tier: callers must not modify it in place.
    - `get(key, check)`: an entry for which `check(key, tensor)` gives a reason is not returned: the tier
      drops it (deletes it from the backend, so nobody reads it again) and counts the lookup as a miss and
      as `invalid`. Entries the tier cannot parse are dropped and counted the same way.
    - `put(key, tensor)` stores a value; it may silently decline (too large, backend down, queue
      full). A put is never required to be visible to an immediately following get.
    - Neither raises because the backend is unavailable, slow or returns damaged data: those are
      misses (counted in stats), because the caller can always recompute the embedding.
      Programming errors (wrong argument types) still raise.
    - All methods are thread-safe.
    - `stats()` returns a plain snapshot dict of counters and gauges (ints, floats, strings),
      cheap enough to call on every metrics scrape.
    """

    name: str

    @abstractmethod
    def get(self, key: EmbeddingKey, check: Check | None = None) -> torch.Tensor | None: ...

    @abstractmethod
    def put(self, key: EmbeddingKey, tensor: torch.Tensor) -> None: ...

    def get_many(self, keys: Sequence[EmbeddingKey], check: Check | None = None) -> list[torch.Tensor | None]:
        """Batch lookup; tiers with a round-trip cost override it."""
        return [self.get(k, check) for k in keys]

    @abstractmethod
    def stats(self) -> dict[str, int | float | str]: ...

    def close(self) -> None:
        """Release background threads and connections; the tier must not be used afterwards."""
        return None  # nothing to release by default
