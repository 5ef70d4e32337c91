"""Embedding cache for vision-encoder (connector) outputs: L1 memory LRU, optional L2 Redis."""

from cache.breaker import BreakerState, CircuitBreaker
from cache.embedding_cache import EmbeddingCache
from cache.key import EmbeddingKey
from cache.layout import EmbeddingLayout
from cache.memory import MemoryTier
from cache.redis_tier import RedisTier
from cache.tier import EmbeddingTier

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "EmbeddingCache",
    "EmbeddingKey",
    "EmbeddingLayout",
    "EmbeddingTier",
    "MemoryTier",
    "RedisTier",
]
