"""``QERL_THREADS``: the CPU thread count of ``qerl demo``, the experiment grid and notebooks 01-04.

Without a GPU those set torch's intra-op threads to 1: the tiny model's matmuls are too small to gain
from more, and extra threads compete with everything else on a small machine (measured: 3x slower
with 2 threads on a busy 2-core CPU). ``QERL_THREADS=n`` overrides it. ``cpu_threads()`` is the one
reader of the variable: a value that is not an int in [1, 1024] is a ConfigError naming QERL_THREADS
and the value (``qerl`` prints it as one line), never a traceback from ``int()`` or torch.
"""

from __future__ import annotations

import os

from qerl_kit.config_types import check_value

__all__ = ["THREADS_ENV", "THREADS_MAX", "cpu_threads", "set_cpu_threads"]

THREADS_ENV = "QERL_THREADS"
THREADS_MAX = 1024  # far past any CPU this runs on; a typo such as 10**6 is refused, not handed to OpenMP


def cpu_threads(default: int = 1) -> int:
    """The thread count ``$QERL_THREADS`` asks for (``default`` when unset or empty)."""
    raw = os.environ.get(THREADS_ENV, "")
    if not raw.strip():
        return default
    return check_value(THREADS_ENV, raw, int, ge=1, le=THREADS_MAX,
                       why="torch's CPU threads, set as an environment variable")


def set_cpu_threads(default: int = 1) -> int:
    """``torch.set_num_threads(cpu_threads(default))``; returns the count."""
    import torch

    n = cpu_threads(default)
    torch.set_num_threads(n)
    return n
