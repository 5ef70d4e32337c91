"""Prometheus export of EmbeddingCache.stats(), read at scrape time (nothing on the hot path).

Optional: the server registers it with `registry.register(EmbeddingCacheCollector(cache))`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache.breaker import BreakerState
from cache.embedding_cache import EmbeddingCache

_NS = "vlmserve_embedding_cache"

# stats key -> (metric name without namespace, help); only keys a tier reports are exported.
_COUNTERS = {
    "hits": ("hits", "Lookups answered by this tier."),
    "misses": ("misses", "Lookups this tier could not answer (errors and corrupt entries included)."),
    "evictions": ("evictions", "Entries evicted to stay within the byte bound."),
    "rejected": ("rejected", "Puts larger than the whole tier capacity."),
    "errors": ("errors", "Backend calls that failed (connection, timeout, server error)."),
    "corrupt": ("corrupt", "Stored values rejected by the header check."),
    "invalid": (
        "invalid",
        "Entries read back that were malformed or did not fit their key (dtype, shape, levels): misses, deleted.",
    ),
    "short_circuited": ("short_circuited", "Calls skipped because the circuit breaker was open."),
    "puts": ("puts", "Values written to the backend."),
    "dropped_puts": ("dropped_puts", "Puts not written (breaker open, queue full, too large, failed)."),
}
_GAUGES = {
    "bytes": ("bytes", "Bytes held: the tensors' data and objects, the keys and the table."),
    "entries": ("entries", "Entries held."),
    "capacity_bytes": ("capacity_bytes", "Byte bound of the tier."),
    "pending_puts": ("pending_puts", "Puts queued for the background writer."),
}


class EmbeddingCacheCollector(Collector):
    def __init__(self, cache: EmbeddingCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        stats = self.cache.stats()
        for family_type, specs in ((CounterMetricFamily, _COUNTERS), (GaugeMetricFamily, _GAUGES)):
            for key, (name, doc) in specs.items():
                family = family_type(f"{_NS}_{name}", doc, labels=["tier"])
                for tier, snap in stats.items():
                    if key in snap:
                        family.add_metric([tier], float(snap[key]))
                if family.samples:
                    yield family
        state = GaugeMetricFamily(
            f"{_NS}_breaker_state", "1 for the circuit breaker's current state.", labels=["tier", "state"]
        )
        opens = CounterMetricFamily(
            f"{_NS}_breaker_opens", "Times the circuit breaker opened.", labels=["tier"]
        )
        for tier, snap in stats.items():
            if "breaker_state" in snap:
                for s in BreakerState:
                    state.add_metric([tier, s.value], float(snap["breaker_state"] == s.value))
                opens.add_metric([tier], float(snap["breaker_opens"]))
        if state.samples:
            yield state
            yield opens
