"""The engine says what each phase of its start took: one log line a benchmark parses, and /metrics gauges."""

from __future__ import annotations

import logging
import re

import pytest

from lm_engine.startup import StartupPhases

LINE = re.compile(r"start-up ([0-9.]+) s: (.*)")
PHASE = re.compile(r"(\S+) ([0-9.]+) s")


def parse(line: str) -> tuple[float, dict[str, float]]:
    """As the benchmark reads it."""
    total, rest = LINE.search(line).groups()
    return float(total), {m[1]: float(m[2]) for m in (PHASE.fullmatch(p) for p in rest.split(", "))}


def test_phases_are_laps_with_probe_time_moved_out():
    ticks = iter([0.0, 0.5, 3.5, 4.0])
    probing = iter([0.0, 0.0, 2.0, 2.0])
    phases = StartupPhases(
        clock=lambda: next(ticks), probe_seconds=lambda: next(probing), before={"imports": 2.0}
    )
    phases.lap("config")
    phases.lap("load")  # 3 s, 2 of them measuring a probe
    phases.lap("load")  # a phase met again adds up
    assert phases.phases == {"imports": 2.0, "config": 0.5, "probes": 2.0, "load": 1.5}
    assert phases.total == 6.0
    assert phases.line() == "start-up 6.0 s: imports 2.0 s, config 0.5 s, probes 2.0 s, load 1.5 s"
    assert parse(phases.line()) == (6.0, phases.phases)


def test_the_engine_logs_its_phases_and_keeps_them(tiny_ckpt, caplog):
    from lm_engine import LLM

    with caplog.at_level(logging.INFO, logger="vlmserve.engine"):
        llm = LLM(str(tiny_ckpt), kv_cache_memory=4 << 20, max_model_len=512)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up ")]
    total, phases = parse(line)
    engine = llm.engine
    assert list(phases) == list(engine.startup_phases)
    assert {"config", "probes", "load", "pack", "warm-up", "kv", "pools"} <= phases.keys()
    assert total == pytest.approx(sum(engine.startup_phases.values()), abs=0.05 + 0.05 * len(phases))
    llm.close()


def test_metrics_export_the_phases_and_the_pool(tiny_ckpt):
    from fastapi.testclient import TestClient

    from api.config import ServerArgs
    from api.server import create_app
    from lm_engine.config import EngineConfig

    args = ServerArgs(engine=EngineConfig(model=str(tiny_ckpt), num_kv_blocks=64))
    with TestClient(create_app(args)) as client:
        text = client.get("/metrics").text
        engine = client.app.state.engine.engine
    for phase in engine.startup_phases:
        assert re.search(rf'^vlmserve_startup_seconds{{phase="{phase}"}} [0-9.e+-]+$', text, re.M), phase
    assert f"vlmserve_kv_cache_bytes {float(engine.kv_cache_bytes)}" in text
