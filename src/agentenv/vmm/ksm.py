"""Kernel samepage merging for the QEMU processes (opt-in: ``AENV_KSM=on``).

Sandboxes of one template hold many identical private pages that the template file cannot
share: guest pages written the same way in every sandbox (a fork group's, a pool's), QEMU's
own heap, and the library pages the dynamic linker relocated in every process. KSM merges
them into one copy-on-write page. It is off by default because merged pages are a timing side
channel between sandboxes (a write to a merged page is slower): right for one tenant's
rollouts, not for strangers on one host (Firecracker's production host notes say the same).

The mark is process-wide (``PR_SET_MEMORY_MERGE``, Linux 6.4+): set on the server, it is
inherited by every process it starts, and kept across ``exec`` since Linux 6.7, so QEMU needs
no wrapper. Merging itself is ``ksmd``'s work, at the rate the host configures in
/sys/kernel/mm/ksm (``pages_to_scan``, ``sleep_millisecs``).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import VmmError

KSM_SYSFS = Path("/sys/kernel/mm/ksm")
PR_SET_MEMORY_MERGE = 67
NO_KSM = "this kernel has no KSM (CONFIG_KSM, /sys/kernel/mm/ksm)"
NO_PRCTL = "prctl(PR_SET_MEMORY_MERGE) failed: it needs Linux 6.4 or later"
NOT_ACROSS_EXEC = ("the mark does not survive exec on this kernel (Linux 6.7 or later keeps it), so QEMU "
                   "processes would not be merged")
# A child marks itself and execs a reader of its own KSM state: the caller stays unmarked.
_PROBE = ("import ctypes, os, sys\n"
          f"if ctypes.CDLL(None).prctl({PR_SET_MEMORY_MERGE}, 1, 0, 0, 0) != 0: sys.exit(3)\n"
          "os.execvp('cat', ['cat', '/proc/self/ksm_stat'])")


@dataclass(frozen=True)
class KsmStats:
    """Host-wide figures from /sys/kernel/mm/ksm (pages are 4 KiB)."""

    running: bool
    pages_shared: int  # merged pages kept
    pages_sharing: int  # page table entries pointing at them: the pages saved
    profit_bytes: int  # what merging saves, less what its metadata costs


def stats() -> KsmStats | None:
    """None when the kernel has no KSM."""
    if not (KSM_SYSFS / "run").exists():
        return None

    def read(name: str) -> int:
        try:
            return int((KSM_SYSFS / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    return KsmStats(running=read("run") == 1, pages_shared=read("pages_shared"),
                    pages_sharing=read("pages_sharing"), profit_bytes=read("general_profit"))


def unsupported_reason() -> str | None:
    """Why this host cannot merge QEMU processes' pages, or None. Blocking; changes nothing."""
    if not (KSM_SYSFS / "run").exists():
        return NO_KSM
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False)
    if probe.returncode == 3:
        return NO_PRCTL
    if "ksm_merge_any: yes" not in probe.stdout:
        return NOT_ACROSS_EXEC
    return None


def merge_children() -> None:
    """Mark this process, and so every QEMU it starts from now on, as mergeable, and make sure
    ``ksmd`` runs. Blocking (it runs a probe process). Raises VmmError saying what is missing."""
    if (why := unsupported_reason()) is not None:
        raise VmmError(f"AENV_KSM=on, but {why}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0:
        raise VmmError(f"AENV_KSM=on, but {NO_PRCTL} (errno {ctypes.get_errno()})")
    if (KSM_SYSFS / "run").read_text().strip() != "1":
        (KSM_SYSFS / "run").write_text("1\n")
