"""Prometheus metrics: request latencies observed by the API, engine state read from its published snapshot.

One registry per app. Other stages add their collectors with ``ServerMetrics.register`` (e.g.
``cache.metrics.EmbeddingCacheCollector``, preprocess and encoder collectors); nothing is read from
them until a scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.async_engine import EngineStats

_NS = "vlmserve"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        gauges = {
            "engine_alive": ("1 while the engine thread runs.", float(s.alive)),
            "num_requests_running": ("Requests with sequences in the running batch.", s.running_requests),
            "num_requests_waiting": ("Requests waiting for admission (or preempted).", s.waiting_requests),
            "num_sequences_running": ("Sequences (choices) in the running batch.", s.running_seqs),
            "kv_cache_blocks_free": (
                "KV blocks not held by any sequence (cached-free included).",
                s.free_blocks,
            ),
            "kv_cache_blocks_total": ("KV blocks in the pool.", s.total_blocks),
            "kv_cache_usage_perc": (
                "Fraction of KV blocks held by sequences.",
                1.0 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0,
            ),
            "visual_budget_level": (
                "Visual budget level new detail=auto images get (0 = full resolution; higher = fewer pixels).",
                s.visual_level,
            ),
            "admission_overloaded": (
                "1 while admission control refuses new work: the queue ahead would take longer than the TTFT SLO.",
                float(s.overloaded),
            ),
            "queue_expected_wait_seconds": (
                "Queued prefill work (visual tokens included) over the measured prefill throughput.",
                s.expected_wait_s,
            ),
            "prefix_cache_hit_rate": (
                "Prompt tokens served by the prefix cache / prompt tokens looked up, since start.",
                s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
            ),
            "requests_tracked": ("Requests the engine holds state for (0 when idle).", s.requests_tracked),
            "encoded_images_held": ("Image embeddings held for the live requests.", s.encoded_images),
            "encoded_images_held_bytes": ("Bytes of those embeddings.", s.encoded_image_bytes),
            "prefix_cache_index_entries": (
                "KV blocks indexed by the prefix cache (at most kv_cache_blocks_total).",
                s.prefix_index_entries,
            ),
            "kv_cache_bytes": ("Bytes of the KV pool (allocated at start-up).", s.kv_cache_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{_NS}_{name}", doc, value=float(value))
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_hits),
            "engine_steps": ("Engine steps run.", s.steps),
            "num_preemptions": ("Sequences preempted (recomputed later).", s.preemptions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"{_NS}_{name}", doc, value=float(value))


class StartupCollector(Collector):
    """How long each phase of the engine's start took (``LLMEngine.startup_phases``; fixed once it started)."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases = dict(phases)

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            f"{_NS}_startup_seconds",
            "Seconds each start-up phase took (they add up to the whole start; probes: measuring what is not cached).",
            labels=["phase"],
        )
        for phase, seconds in self.phases.items():
            gauge.add_metric([phase], seconds)
        yield gauge


class _ProcessMemoryCollector(Collector):
    """This process's proportional set size (PSS: shared pages split between their sharers), which RSS
    overstates for a server sharing its libraries and shared memory with its preprocess workers."""

    def collect(self) -> Iterator[Metric]:
        pss = _pss_bytes()
        if pss is not None:
            yield GaugeMetricFamily(f"{_NS}_process_pss_bytes", "Proportional set size of the server.", pss)


def _pss_bytes() -> int | None:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux, or no /proc
        pass
    return None


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            f"{_NS}_time_to_first_token_seconds",
            "Request arrival (before media fetch and preprocessing) to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{_NS}_time_per_output_token_seconds",
            "Mean time between output tokens of a finished request (after the first).",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{_NS}_e2e_request_latency_seconds",
            "Request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            f"{_NS}_requests",
            "Chat completion requests by outcome: ok, aborted (client gone), client_error (4xx), unavailable (503), "
            "server_error (other 5xx).",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{_NS}_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            f"{_NS}_cached_prompt_tokens", "Prompt tokens served by the prefix cache.", registry=r
        )
        self.generation_tokens = Counter(f"{_NS}_generation_tokens", "Tokens generated.", registry=r)
        self.register(_EngineCollector(snapshot))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, CPU seconds
        self.register(_ProcessMemoryCollector())

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def count(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def count_error(self, http_status: int) -> None:
        if http_status == 503:
            self.count("unavailable")  # admission control's refusal, or no engine
        else:
            self.count("server_error" if http_status >= 500 else "client_error")

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
