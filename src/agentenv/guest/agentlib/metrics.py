"""``GET /metrics``: the sandbox's resource usage, from /proc and statvfs, as envd reports it."""

from __future__ import annotations

import os
import threading
import time

_lock = threading.Lock()
_last_cpu: tuple[float, int, int] | None = None  # (monotonic time, total jiffies, idle jiffies)
MIN_CPU_WINDOW = 0.1  # seconds between two /proc/stat samples for a meaningful percentage


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is already
    # counted in user/nice, so only the first eight add up to the total.
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]), idle


def cpu_used_pct() -> float:
    """Busy share of all CPUs since the previous call (or over the last 100 ms on the first)."""
    global _last_cpu
    with _lock:
        now = time.monotonic()
        if _last_cpu is None or now - _last_cpu[0] < MIN_CPU_WINDOW:
            total, idle = _cpu_times()
            time.sleep(MIN_CPU_WINDOW)
            prev = (now, total, idle)
        else:
            prev = _last_cpu
        total, idle = _cpu_times()
        _last_cpu = (time.monotonic(), total, idle)
    d_total, d_idle = total - prev[1], idle - prev[2]
    return round(100.0 * (d_total - d_idle) / d_total, 2) if d_total > 0 else 0.0


def memory() -> dict[str, int]:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024
    total = info["MemTotal"]
    available = info.get("MemAvailable", info.get("MemFree", 0) + info.get("Cached", 0))
    return {"mem_total": total, "mem_used": total - available,
            "mem_cache": info.get("Cached", 0) + info.get("SReclaimable", 0) + info.get("Buffers", 0)}


def collect(disk_path: str = "/") -> dict:
    """All fields of envd's metrics response; byte counts, ``ts`` in Unix seconds."""
    mem = memory()
    st = os.statvfs(disk_path)
    return {
        "ts": int(time.time()),
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": cpu_used_pct(),
        **mem,
        "mem_total_mib": mem["mem_total"] // (1024 * 1024),
        "mem_used_mib": mem["mem_used"] // (1024 * 1024),
        "disk_used": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "disk_total": st.f_blocks * st.f_frsize,
    }
