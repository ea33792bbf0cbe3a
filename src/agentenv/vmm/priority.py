"""CPU priority of a whole QEMU process: VMs made ahead of time run behind live sandboxes.

Why: the warm pool and the primed sandboxes of hot snapshots restore and prime VMs in the
background. Under TCG that is hundreds of milliseconds of CPU per VM, and on a small host it
competed on equal terms with the sandboxes users are running commands in (and with the one
just handed out, whose refill starts at once). A VM made ahead of time therefore runs at a
lower priority until it is handed out.

Two mechanisms, both set: a QEMU launched with ``-daemonize`` is in a session of its own, and
with autogroup scheduling (``kernel.sched_autogroup_enabled``, on by default) the scheduler
shares the CPU between sessions first, so only the session's nice value
(``/proc/PID/autogroup``) ranks it against the other VMs; when the process sits in a cgroup
with the cpu controller, autogroups do not apply and each thread's own nice value does.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def set_nice(pid: int, nice: int) -> None:
    """Give process ``pid`` (every thread of it, and its session's autogroup) the nice value
    ``nice``. A process that has gone meanwhile is not an error: there is nothing to rank."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        if _autogroups_on() and _own_autogroup(pid):
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        # Threads start with their creator's value: QEMU's later threads (its I/O workers,
        # made by the main thread) follow without being listed here.
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _own_autogroup(pid: int) -> bool:
    """Whether ``pid`` is in another autogroup than this server: the value is the group's,
    and a process that shared ours would rank the server (and all it runs) with it."""
    group = Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    return group != Path("/proc/self/autogroup").read_text().split()[0]


def _autogroups_on() -> bool:
    try:
        return AUTOGROUP_SWITCH.read_text().strip() == "1"
    except OSError:
        return False
