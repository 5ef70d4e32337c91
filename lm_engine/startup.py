"""What each part of an engine's start took, for the log line and the server's metrics.

The phases are laps of one clock: each covers the time since the one before, so they add up to the whole start.
Time spent measuring start-up probes (runtime/timing_cache.py) is moved out of the phase that ran them into
``probes``, which reads 0.0 s once the results are cached.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from runtime.timing_cache import measured_seconds


class StartupPhases:
    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        probe_seconds: Callable[[], float] = measured_seconds,
        before: dict[str, float] | None = None,
    ) -> None:
        """``before``: phases that ran before this object existed (the server's imports), in seconds."""
        self.clock, self.probe_seconds = clock, probe_seconds
        self.phases: dict[str, float] = dict(before or {})
        self._last, self._probes_last = clock(), probe_seconds()

    def lap(self, name: str) -> None:
        """The time since the last lap was phase ``name`` (added to it where it ran before), probes apart."""
        now, probes = self.clock(), self.probe_seconds()
        probing = probes - self._probes_last
        self.phases[name] = self.phases.get(name, 0.0) + max(0.0, now - self._last - probing)
        self.phases["probes"] = self.phases.get("probes", 0.0) + probing
        self._last, self._probes_last = now, probes

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def line(self) -> str:
        """``start-up 12.3 s: config 0.1 s, load 3.1 s, ...``. NOTE: benchmarks parse it (``start-up ([0-9.]+) s:
        (.*)``, then ``name N s`` pieces joined by ``, ``): keep the format, and phase names without spaces."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        return f"start-up {self.total:.1f} s: {parts}"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc against the boot clock); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # NOTE: field 22 (starttime, clock ticks after boot); split after the command name, which may hold spaces
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
