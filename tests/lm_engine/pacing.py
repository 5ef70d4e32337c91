"""Engine pacing for tests: a clock that moves only when a step runs, and steps that start only once the
encoder has returned what the steps before them asked for. With both, what an engine does step by step no
longer depends on how fast the machine runs the model or the encoder threads."""

from __future__ import annotations

import time

from lm_engine import LLMEngine


class VirtualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def paced(engine: LLMEngine, clock: VirtualClock, step_s: float) -> None:
    """Each model step takes ``step_s`` on ``clock`` (and no real time beyond its own)."""
    real_execute = engine.runner.execute

    def execute(sched, embeddings):
        clock.advance(step_s)
        return real_execute(sched, embeddings)

    engine.runner.execute = execute


def encoded_first(engine: LLMEngine) -> None:
    """Each step starts once every image the steps before it sent to the encoder is back, so which requests
    a step can run does not depend on how fast the encoder threads are."""
    real_step = engine.step

    def step():
        deadline = time.monotonic() + 120
        engine.images.collect()
        while engine.images.waiting:
            assert time.monotonic() < deadline, "the encoder did not finish"
            engine.images.wait(0.05)
            engine.images.collect()
        return real_step()

    engine.step = step
