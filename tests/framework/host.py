"""What a node leaves on the host: QEMU processes, namespaces, run dirs. Tests diff these."""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

from agentenv.bench.node import qemu_gone, qemu_pids

__all__ = ["qemu_pids", "qemu_gone", "netns_names", "netns_of", "node_netns", "sandbox_dirs", "cpu_nice",
           "frozen", "thaw", "store_unwritable"]


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def netns_of(pid: int) -> str:
    """The named network namespace a process runs in ("" if none)."""
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


def sandbox_dirs(data_dir: Path) -> set[str]:
    d = data_dir / "sandboxes"
    return {p.name for p in d.iterdir()} if d.exists() else set()


def node_netns(data_dir: Path) -> set[str]:
    """The namespaces of one node (named after its tag), not those of other test servers."""
    from agentenv.config import Settings

    prefix = f"aenv-{Settings(data_dir=data_dir).instance_tag[:4]}-"
    return {n for n in netns_names() if n.startswith(prefix)}


def cpu_nice(pid: int) -> set[int]:
    """The nice values a process runs at, as the scheduler ranks it: each thread's, and its
    session's autogroup's when autogroup scheduling is on (vmm/priority.py)."""
    values = {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
    group = Path(f"/proc/{pid}/autogroup").read_text().split()  # empty: the kernel's default group
    if group and Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        values.add(int(group[-1]))
    return values


FREEZER = Path("/sys/fs/cgroup/freezer")


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Freeze a process in a cgroup-v1 freezer group: it stops in the kernel and does not exit
    on SIGKILL until thawed (as a process stuck in uninterruptible I/O). The fault a platform
    meets when a QEMU will not die; thawed on the way out, where the pending kill lands."""
    if not (FREEZER / "cgroup.procs").exists():  # the hierarchy is not mounted there
        FREEZER.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "cgroup", "-o", "freezer", "freezer", str(FREEZER)], check=True)
    group = FREEZER / f"aenv-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            (group / "tasks").write_text(tid)
        (group / "freezer.state").write_text("FROZEN")
        while (group / "freezer.state").read_text().strip() != "FROZEN":
            pass
        yield
    finally:
        thaw(group)


def thaw(group: Path) -> None:
    """Thaw a freezer group made by ``frozen``, move what is left in it out, and remove it."""
    (group / "freezer.state").write_text("THAWED")
    for tid in (group / "tasks").read_text().split():
        with contextlib.suppress(OSError):  # gone meanwhile
            (group.parent / "tasks").write_text(tid)
    group.rmdir()


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


@contextlib.contextmanager
def store_unwritable(data_dir: Path) -> Iterator[None]:
    """The node's SQLite store fails every write with a real I/O error: its write-ahead log is
    made immutable (as a failing or read-only disk under it would), and writable again after."""
    fd = os.open(data_dir / "state.sqlite-wal", os.O_RDONLY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("l", [flags[0] | FS_IMMUTABLE_FL]), True)
        try:
            yield
        finally:
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    finally:
        os.close(fd)
