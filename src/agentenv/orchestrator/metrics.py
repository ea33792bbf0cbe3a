"""Guest resource metrics (E2B's ``SandboxMetric``), sampled when asked for.

A sample is read from the guest's /proc and statfs through the agent, at most one every
SAMPLE_EVERY_S per sandbox, not by a background poller: an idle sandbox costs nothing. The
samples of a sandbox are kept while it exists (a paused one answers with its history, as
E2B's does), the newest KEEP of them.
"""

from __future__ import annotations

import time
from typing import Any

from agentenv.errors import PlatformError
from agentenv.orchestrator.sandbox import LiveSandbox

SAMPLE_EVERY_S = 5
KEEP = 720  # an hour of samples at the highest rate

_SCRIPT = ("head -1 /proc/stat; sleep 0.5; head -1 /proc/stat; "
           "grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; stat -f -c '%S %b %f' /")


class GuestMetrics:
    def __init__(self) -> None:
        self._samples: dict[str, list[dict[str, Any]]] = {}

    def forget(self, sandbox_id: str) -> None:
        self._samples.pop(sandbox_id, None)

    async def points(self, live: LiveSandbox, start: float | None, end: float | None,
                     sample: bool) -> list[dict[str, Any]]:
        """The samples inside [start, end] (unix seconds), after taking a new one if ``sample``
        (the guest runs), the last is older than SAMPLE_EVERY_S and the range reaches now."""
        samples = self._samples.setdefault(live.id, [])
        now = time.time()
        if sample and (not samples or now - samples[-1]["timestampUnix"] >= SAMPLE_EVERY_S) \
                and (end is None or end >= now - 1):
            samples.append(await _sample(live))
            del samples[:-KEEP]
        lo = live.record.started_at - 1 if start is None else start
        hi = time.time() + 1 if end is None else end  # after sampling: a sample can take seconds
        return [m for m in samples if lo <= m["timestampUnix"] <= hi]


async def _sample(live: LiveSandbox) -> dict[str, Any]:
    assert live.envd is not None
    res = await live.envd.run(["sh", "-c", _SCRIPT], user="root", timeout=10)
    lines = res.stdout.decode().splitlines()
    if res.exit_code != 0 or len(lines) < 6:
        raise PlatformError(f"sandbox {live.id}: could not read guest metrics: {res.stderr.decode()[-300:]}")
    try:
        a = [int(x) for x in lines[0].split()[1:]]
        b = [int(x) for x in lines[1].split()[1:]]
        total = sum(b) - sum(a)
        idle = (b[3] + b[4]) - (a[3] + a[4])  # idle + iowait
        mem = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines[2:5]}
        bsize, blocks, free = (int(x) for x in lines[5].split())
        used, cached = mem["MemTotal"] - mem["MemAvailable"], mem["Cached"]
    except (ValueError, IndexError, KeyError) as exc:  # the guest's tools are the user's to change
        raise PlatformError(f"sandbox {live.id}: its guest metrics did not read as expected ({exc!r})") from exc
    return {
        "timestampUnix": int(time.time()), "cpuCount": live.record.vcpus,
        "cpuUsedPct": round(100.0 * (total - idle) / total, 2) if total > 0 else 0.0,
        "memUsed": used, "memTotal": mem["MemTotal"],
        "memCache": cached, "diskUsed": (blocks - free) * bsize, "diskTotal": blocks * bsize,
    }
