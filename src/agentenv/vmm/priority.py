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

Best effort: a priority that cannot be set (no CAP_SYS_NICE, a kernel without autogroups) is
logged and the VM runs at the priority it has. It is never a reason to fail a create.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def lower(pid: int, steps: int) -> bool:
    """Rank process ``pid`` ``steps`` nice values below this server. True if it was done."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    return _apply(pid, autogroup=steps, threads=min(19, own + steps))


def restore(pid: int) -> None:
    """Rank ``pid`` as a VM this server launches now: its session's autogroup at 0 (where a
    new session starts) and every thread at the server's own nice value."""
    _apply(pid, autogroup=0, threads=os.getpriority(os.PRIO_PROCESS, 0))


def _apply(pid: int, *, autogroup: int, threads: int) -> bool:
    try:
        _set_autogroup(pid, autogroup)
        _set_threads(pid, threads)
        return True
    except ProcessLookupError:
        return False  # gone meanwhile: there is nothing to rank
    except OSError as exc:
        log.warning("could not set the CPU priority of QEMU %d (%s); it keeps the one it has", pid, exc)
        return False


def _set_autogroup(pid: int, nice: int) -> None:
    """Only a group that is not this server's: the value is the group's, and a process that
    shared ours would rank the server (and all it runs) with it. Written whether autogroups are
    on or not: the value takes effect when they are."""
    try:
        group = Path(f"/proc/{pid}/autogroup").read_text().split()[0]
        own = Path("/proc/self/autogroup").read_text().split()[0]
    except FileNotFoundError:
        if not Path(f"/proc/{pid}").exists():
            raise ProcessLookupError(pid) from None
        return  # a kernel without autogroups
    if group != own:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _set_threads(pid: int, nice: int) -> None:
    """Every thread, listed again until no new one appeared: a thread starts with its
    creator's value, so one made by a thread not yet set would keep the old one."""
    done: set[int] = set()
    while True:
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        except FileNotFoundError:
            raise ProcessLookupError(pid) from None
        if not tids - done:
            return
        for tid in tids - done:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        done |= tids
