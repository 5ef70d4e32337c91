"""A server's /metrics as a flat dict, and the state every test waits for: nothing running or waiting."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float]:
    """``name{label=value,...}`` (labels sorted) → value, for every sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def is_idle(m: dict[str, float]) -> bool:
    """No request runs or waits and every KV block is free."""
    return (
        m["vlmserve_num_requests_running"] == 0
        and m["vlmserve_num_requests_waiting"] == 0
        and m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
    )
