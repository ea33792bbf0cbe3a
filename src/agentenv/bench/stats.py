"""min / median / p99 of a list of samples."""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentenv.bench.node import LocalNode


def summarize(samples: list[float]) -> dict[str, float | int]:
    if not samples:
        return {"min": math.nan, "median": math.nan, "p99": math.nan, "runs": 0}
    s = sorted(samples)
    # Nearest-rank p99: with few runs it is the maximum, which is the honest reading.
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return {"min": round(s[0], 3), "median": round(statistics.median(s), 3), "p99": round(p99, 3), "runs": len(s)}


def wait_pool(node: LocalNode, timeout: float = 60) -> None:
    """Let the node's warm pool (and the shells of hot snapshots) refill, so that a measurement
    does not share the CPU with restores running in the background."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = node.details()
        if (d.get("poolReady", 0) >= d.get("poolSize", 0)
                and d.get("snapshotShellsReady", 0) >= d.get("snapshotShellsWanted", 0)):
            return
        time.sleep(0.05)
