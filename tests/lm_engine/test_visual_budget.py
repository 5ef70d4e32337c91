"""The visual budget controller on synthetic signals: pressure → level, hysteresis, dwell, recovery."""

from __future__ import annotations

import pytest

from lm_engine.visual_budget import BudgetSignals, TTFTWindow, VisualBudgetController, default_ladder

LADDER = [1_000_000, 500_000, 250_000, 3136]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def controller(clock: Clock, **kw) -> VisualBudgetController:
    return VisualBudgetController(
        ladder=LADDER, ttft_slo_s=1.0, dwell_s=1.0, drain_steps=4, clock=clock, **kw
    )


def sig(queued=0, kv=0.0, ttft=None, budget=100) -> BudgetSignals:
    return BudgetSignals(queued_tokens=queued, token_budget=budget, kv_usage=kv, recent_ttft_s=ttft)


def run(
    c: VisualBudgetController, clock: Clock, s: BudgetSignals, seconds: float, dt: float = 0.1
) -> list[int]:
    levels = []
    for _ in range(round(seconds / dt)):
        clock.t += dt
        levels.append(c.update(s))
    return levels


def test_each_signal_maps_to_pressure():
    c = controller(Clock())
    assert c.compute_pressure(sig(queued=400)) == pytest.approx(1.0)  # 4 steps × 100 tokens
    assert c.compute_pressure(sig(kv=0.45)) == pytest.approx(0.5)
    assert c.compute_pressure(sig(queued=1, ttft=3.0)) == pytest.approx(3.0)
    assert c.compute_pressure(sig(queued=0, ttft=3.0)) == 0.0  # a stale TTFT with nothing queued
    assert c.compute_pressure(sig(queued=40, kv=0.09, ttft=0.2)) == pytest.approx(0.2)


def test_sustained_pressure_steps_down_once_per_dwell_to_the_floor():
    clock = Clock()
    c = controller(clock)
    levels = run(c, clock, sig(queued=1000), 5.0)
    assert levels[0] == 0
    first_drop = levels.index(1)
    assert 1.0 <= (first_drop + 1) * 0.1 <= 1.25  # one dwell (+ a tick) of sustained pressure first
    assert levels.index(2) - first_drop == pytest.approx(10, abs=1)  # then one level per dwell
    assert levels[-1] == c.lowest
    assert c.max_pixels() == LADDER[-1]


def test_hysteresis_band_holds_the_level():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 1.5)
    assert c.level == 1
    # Pressure 0.75 sits between low (0.5) and high (1.0): nothing moves, however long.
    assert set(run(c, clock, sig(queued=300), 10.0)) == {1}


def test_short_spikes_do_not_oscillate():
    clock = Clock()
    c = controller(clock)
    for _ in range(10):  # 0.5 s over, 0.5 s under: never a full dwell either way
        run(c, clock, sig(queued=1000), 0.5)
        run(c, clock, sig(queued=0), 0.5)
    assert c.level == 0 and not c.history


def test_recovery_after_the_burst_and_after_idle():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 4.0)
    assert c.level == c.lowest
    levels = run(c, clock, sig(queued=0), 4.0)
    assert levels[-1] == 0 and sorted(levels, reverse=True) == levels  # monotone climb back
    # A quiet spell with no updates at all (idle engine) also counts as time below `low`.
    run(c, clock, sig(queued=1000), 4.0)
    clock.t += 30.0
    assert c.update(sig()) == 0


def test_detail_semantics_and_fixed_mode():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 2.5)
    assert c.level == 2
    assert c.max_pixels("auto") == LADDER[2] and c.max_pixels(None) == LADDER[2]
    assert c.max_pixels("low") == LADDER[-1] and c.max_pixels("high") == LADDER[0]
    fixed = controller(Clock(), enabled=False)
    run(fixed, clock, sig(queued=1000), 5.0)
    assert (
        fixed.level == 0 and fixed.max_pixels("auto") == LADDER[0] and fixed.max_pixels("low") == LADDER[-1]
    )


def test_saturated_only_at_the_floor_under_pressure():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 3.5)
    assert c.level == c.lowest and not c.saturated
    run(c, clock, sig(queued=1000), 1.2)
    assert c.saturated
    run(c, clock, sig(queued=0), 0.2)
    assert not c.saturated


def test_ladder_and_ttft_window():
    assert default_ladder(1_003_520, 3136) == [1_003_520, 501_760, 250_880, 3136]
    assert default_ladder(6272, 3136) == [6272, 3136]
    with pytest.raises(ValueError):
        VisualBudgetController(ladder=[100, 200])
    clock = Clock()
    w = TTFTWindow(window_s=5.0, clock=clock)
    assert w.percentile() is None
    for i in range(10):
        w.add(float(i))
    assert w.percentile(0.9) == 9.0
    clock.t = 6.0
    assert w.percentile() is None
