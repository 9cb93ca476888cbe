"""The Kubernetes HorizontalPodAutoscaler's algorithm, as the fleet simulator applies it.

For each metric (an average value per pod, here mean queue depth and mean tokens in flight per
replica, what the ScaledObject in deploy/ reads from Prometheus):
    desired_m = ceil(current x value / target)       (no change while |value/target - 1| <= tolerance)
desired = max over metrics, then
- scale up only to the lowest recommendation of the last `scale_up_window_s` (0, the Kubernetes
  default, as in deploy/), and at most by the default policy: max(4 pods, 100% of current) per sync
  period;
- scale down only to the highest recommendation of the last `scale_down_window_s` (the default
  stabilisation window, 300 s), so a short dip does not remove replicas;
- clamped to [min_replicas, max_replicas].
Reference: kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale ("Algorithm details",
"Stabilization window", "Default Behavior").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Hpa:
    min_replicas: int = 1
    max_replicas: int = 100
    tolerance: float = 0.1
    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 0.0
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    _history: deque = field(default_factory=deque)  # (time, recommendation)

    def recommend(self, current: int, metrics: dict[str, tuple[float, float]]) -> int:
        """The raw recommendation: max over metrics of ceil(current x value / target)."""
        want = []
        for value, target in metrics.values():
            ratio = value / target if target > 0 else 0.0
            if abs(ratio - 1.0) <= self.tolerance:
                want.append(current)
            else:
                want.append(math.ceil(current * ratio))
        return max(want) if want else current

    def desired(self, now: float, current: int, metrics: dict[str, tuple[float, float]]) -> int:
        rec = max(self.min_replicas, min(self.max_replicas, self.recommend(max(1, current), metrics)))
        self._history.append((now, rec))
        while self._history and self._history[0][0] < now - max(self.scale_down_window_s, self.scale_up_window_s):
            self._history.popleft()
        if rec < current:  # stabilised: the highest recommendation in the window
            rec = min(current, max(r for t, r in self._history if t >= now - self.scale_down_window_s))
        elif rec > current:  # stabilised: the lowest recommendation in the window
            rec = max(current, min(r for t, r in self._history if t >= now - self.scale_up_window_s))
            rec = min(rec, current + max(self.scale_up_pods, math.ceil(current * self.scale_up_percent / 100)))
        return max(self.min_replicas, min(self.max_replicas, rec))
