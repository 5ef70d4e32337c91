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
        st = self.pipeline.stats
        yield CounterMetricFamily("vlmserve_encoder_batches", "Vision-tower batches run.", value=st.batches)
        yield CounterMetricFamily(
            "vlmserve_encoder_images", "Images encoded (cache misses).", value=st.images
        )
        yield CounterMetricFamily(
            "vlmserve_encoder_patches", "Patches through the vision tower.", value=st.patches
        )
        yield CounterMetricFamily(
            "vlmserve_encoder_seconds", "Wall time in the vision tower.", value=st.encode_seconds
        )
        yield CounterMetricFamily(
            "vlmserve_image_errors", "Images that failed preprocessing or encoding.", value=st.errors
        )
        yield GaugeMetricFamily(
            "vlmserve_encoder_pending", "Image keys waiting for an embedding.", value=self.pipeline.pending
        )
        sizes = list(st.batch_images)
        buckets, total = [], 0
        for bound in _BATCH_BUCKETS:
            buckets.append((str(bound), sum(1 for s in sizes if s <= bound)))
        buckets.append(("+Inf", len(sizes)))
        total = sum(sizes)
        yield HistogramMetricFamily(
            "vlmserve_encoder_batch_images",
            "Images per encoder batch (recent batches).",
            buckets=buckets,
            sum_value=total,
        )
        if self.pool is not None:
            ps = self.pool.stats
            yield CounterMetricFamily(
                "vlmserve_preprocess_images", "Images preprocessed in the pool.", value=ps.images
            )
            yield CounterMetricFamily(
                "vlmserve_preprocess_errors", "Preprocessing failures.", value=ps.errors
            )
            yield CounterMetricFamily(
                "vlmserve_preprocess_seconds",
                "Wall time preprocessing (decode, resize, patchify).",
                value=ps.total_seconds,
            )
            yield CounterMetricFamily(
                "vlmserve_preprocess_worker_restarts",
                "Preprocess workers replaced after dying.",
                value=ps.worker_restarts,
            )
            yield CounterMetricFamily(
                "vlmserve_preprocess_copied_results",
                "Results copied out of shared memory because their worker's leases were all taken.",
                value=ps.copied,
            )
