"""Prometheus export of the vision path: encoder batches and preprocessing latency (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from encoder.pipeline import VisionPipeline

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class VisionPathCollector(Collector):
    def __init__(self, pipeline: VisionPipeline, pool=None) -> None:
        self.pipeline = pipeline
        self.pool = pool  # preprocess.PreprocessPool | None

    def collect(self) -> Iterator[Metric]:
        yield from self._encoder()
        if (remote := getattr(self.pipeline, "remote", None)) is not None:
            yield from _remote(remote)
        if self.pool is not None:
            yield from self._preprocess()

    def _encoder(self) -> Iterator[Metric]:
        st = self.pipeline.stats
        counters = (
            ("vlmserve_encoder_batches", "Vision-tower batches run.", st.batches),
            ("vlmserve_encoder_images", "Images encoded (cache misses).", st.images),
            ("vlmserve_encoder_patches", "Patches through the vision tower.", st.patches),
            ("vlmserve_encoder_seconds", "Wall time in the vision tower.", st.encode_seconds),
            ("vlmserve_image_errors", "Images that failed preprocessing or encoding.", st.errors),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "vlmserve_encoder_pending", "Image keys waiting for an embedding.", value=self.pipeline.pending
        )
        sizes = list(st.batch_images)
        buckets = [(str(bound), sum(1 for s in sizes if s <= bound)) for bound in _BATCH_BUCKETS]
        buckets.append(("+Inf", len(sizes)))
        yield HistogramMetricFamily(
            "vlmserve_encoder_batch_images",
            "Images per encoder batch (recent batches).",
            buckets=buckets,
            sum_value=sum(sizes),
        )

    def _preprocess(self) -> Iterator[Metric]:
        ps = self.pool.stats
        counters = (
            ("vlmserve_preprocess_images", "Images preprocessed in the pool.", ps.images),
            ("vlmserve_preprocess_errors", "Preprocessing failures.", ps.errors),
            (
                "vlmserve_preprocess_seconds",
                "Wall time preprocessing (decode, resize, patchify).",
                ps.total_seconds,
            ),
            (
                "vlmserve_preprocess_worker_restarts",
                "Preprocess workers replaced after dying.",
                ps.worker_restarts,
            ),
            (
                "vlmserve_preprocess_copied_results",
                "Results copied out of shared memory because their worker's leases were all taken.",
                ps.copied,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


def _remote(st) -> Iterator[Metric]:
    """The encoder tier as this engine sees it (encoder.tier.client.RemoteStats)."""
    from encoder.tier.client import SHIP_BUCKETS

    yield CounterMetricFamily(
        "vlmserve_encoder_remote_requests", "Encode requests sent to the encoder pool.", value=st.sent
    )
    yield CounterMetricFamily(
        "vlmserve_encoder_remote_shipped_bytes",
        "Embedding bytes shipped back by the pool.",
        value=st.shipped_bytes,
    )
    counts, acc = [], 0
    for bound, n in zip((*SHIP_BUCKETS, float("inf")), st.ship_seconds):
        acc += n
        counts.append(("+Inf" if bound == float("inf") else str(bound), acc))
    yield HistogramMetricFamily(
        "vlmserve_encoder_remote_ship_seconds",
        "From sending an image to the pool to holding its embedding.",
        buckets=counts,
        sum_value=st.ship_seconds_sum,
    )
    fallbacks = CounterMetricFamily(
        "vlmserve_encoder_remote_fallbacks",
        "Images the pool did not deliver, encoded in-process or failed (by reason).",
        labels=["reason"],
    )
    for reason in (
        "unreachable",
        "timeout",
        "disconnected",
        "remote_error",
        "lost",
        "invalid",
        "ship_failed",
    ):
        fallbacks.add_metric([reason], st.fallbacks.get(reason, 0))
    yield fallbacks
    yield GaugeMetricFamily(
        "vlmserve_encoder_remote_connected", "1 while connected to the pool.", value=float(st.connected)
    )
