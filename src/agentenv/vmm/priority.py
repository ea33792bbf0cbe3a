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
    except Exception as exc:  # noqa: BLE001 — best effort: a priority never fails a launch
        log.warning("could not set the CPU priority of QEMU %d (%s); it keeps the one it has", pid, exc)
        return False


def _set_autogroup(pid: int, nice: int) -> None:
    """Only a group that is not this server's: the value is the group's, and a process that
    shared ours would rank the server (and all it runs) with it. Written whether autogroups are
    on or not: the value takes effect when they are."""
    group = _autogroup(str(pid))
    if group is None:
        if not Path(f"/proc/{pid}").exists():
            raise ProcessLookupError(pid)
        return  # a kernel without autogroups, or a process in the kernel's default group
    if group != _autogroup("self"):
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _autogroup(pid: str) -> str | None:
    """The name of the autogroup ``pid`` is in (``/autogroup-N``), or None when it is in none
    of its own. The file reads empty for a process of the kernel's default group: one whose
    ancestors never started a session, as a server run directly by an init or a CI agent that
    does not call setsid is (its QEMUs, started with -daemonize, each have a group of their
    own). It is missing on a kernel built without autogroups."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except FileNotFoundError:
        return None
    return fields[0] if fields else None


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
