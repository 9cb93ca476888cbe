"""A replica's start, phase by phase: how long the process took to import, to build or load its
compiled kernels, to load the weights and to warm up, in the log as each phase ends and in /metrics
(`lorafarm_replica_start_seconds{phase}`), so a slow start says where its time went."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import psutil
from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger("lorafarm.replica")

PHASES = ("imports", "kernels", "weights", "warm-up")


class StartPhases:
    def __init__(self, registry: CollectorRegistry):
        self.seconds: dict[str, float] = {}
        self._gauge = Gauge("lorafarm_replica_start_seconds",
                            "Seconds the replica's start spent per phase (imports, kernels, weights, warm-up).",
                            ["phase"], registry=registry)

    def add(self, phase: str, seconds: float, cpu: float | None = None) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, seconds)
        self._gauge.labels(phase).set(self.seconds[phase])
        # the CPU time beside the wall time: on a busy machine the gap is the time spent waiting for a core
        log.info("start phase %s: %.2f s%s", phase, seconds, "" if cpu is None else f" ({cpu:.2f} s CPU)")

    @contextmanager
    def phase(self, name: str):
        t0, c0 = time.monotonic(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0, time.process_time() - c0)

    def done(self) -> None:
        log.info("started in %.2f s (%s)", sum(self.seconds.values()),
                 ", ".join(f"{p} {s:.2f} s" for p, s in self.seconds.items()))


def since_process_start() -> tuple[float, float | None]:
    """(wall, CPU) seconds since this process was created: its interpreter start and imports."""
    try:
        p = psutil.Process()
        return time.time() - p.create_time(), sum(p.cpu_times()[:2])
    except psutil.Error:  # no /proc: the phase is not reported
        return 0.0, None
