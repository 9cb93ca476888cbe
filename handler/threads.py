"""Thread priority for background work that must yield to serving (adapter loads, grammar
matchers). Imports nothing of handler/: every room may use it."""

from __future__ import annotations

import os
import threading


def lower_thread_priority(nice: int) -> None:
    """Run the calling thread at `nice` (Linux: per thread; threads it starts, such as an OpenMP
    team, inherit it). Never raises: a platform without it keeps the default priority."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(int(nice), current))
    except (AttributeError, OSError):
        pass
