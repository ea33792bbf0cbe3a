"""Admission by host memory, next to the count limit (``AENV_MAX_SANDBOXES``).

Sandboxes overcommit: guest RAM is copy-on-write over the template's file and TCG's cache is
filled as used, so a node holds far more sandboxes than its RAM divided by theirs. What it
must not do is start one more when the host is nearly out of memory: the kernel's OOM killer
would then pick a QEMU, and a running rollout would lose its sandbox. So creates, resumes,
forks and the warm pool stop while the host's available memory is below a reserve, and the
caller gets a typed "try again" (429) that says why, once the stopped VMs of paused sandboxes
kept for a quick resume have been freed for it (orchestrator/parking.py). Below the reserve
itself, those go first, then the warm pool gives back the shells it holds (an idle restored
sandbox each), so the memory goes to the running sandboxes instead of to ones nobody asked for
yet; a create short of memory gets shells given back the same way before its 429. The pool
refills once two new sandboxes fit again (one more than a create needs: the headroom creates
are admitted into is not the pool's, and the margin keeps shrinking and refilling from
alternating).
"""

from __future__ import annotations

from pathlib import Path

# What a new sandbox costs the host at the least: an idle one is ~58 MB under TCG
# (docs/benchmarks.md, idle_pss_mb), less under KVM. A busy one grows from there.
SANDBOX_MIN_MB = 64
MEMINFO = Path("/proc/meminfo")


def mem_available_mb() -> int | None:
    """The kernel's estimate of memory available for new work (MemAvailable), or None."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_shortfall(reserve_mb: int, more: int = 1, extra_mb: int = 0) -> str | None:
    """Why ``more`` new sandboxes would eat into the reserve, or None when they fit.
    ``extra_mb``: what they take beyond the least (a resume writes its memory layers into
    the new VM's RAM)."""
    avail = mem_available_mb()
    need = more * SANDBOX_MIN_MB + extra_mb
    if avail is None or avail - need >= reserve_mb:
        return None
    return (f"the host has {avail} MiB of memory available and keeps {reserve_mb} MiB free "
            f"(AENV_MEM_RESERVE_MB); {more} more sandbox{'es' if more > 1 else ''} need at least {need} MiB")


def below_reserve(reserve_mb: int) -> bool:
    """Whether the host's available memory is already inside the reserve."""
    avail = mem_available_mb()
    return avail is not None and avail < reserve_mb
