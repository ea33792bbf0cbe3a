"""One server per data directory and per snapshot repository, and no one else in them.

Each server's recovery and garbage collection assume they see every user of their files: at
start, recovery deletes the pause and fork manifests no record of its own names and staging
files of any age, and the gc deletes layers no manifest or sandbox of its own needs. A second
server on the same directory (another node pointed at a shared repository, or a second
server started on one data dir) would delete the first one's snapshots under it. So each
holds an exclusive lock on a file in both for its lifetime; a second one is refused at start
with the holder's name. ``flock`` is released by the kernel when the process dies (a crashed
server does not lock its successor out) and is honoured across NFSv4 clients.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from agentenv.errors import StorageError

LOCK_NAME = ".owner.lock"


def hold(directory: Path, what: str, hint: str) -> int:
    """Lock ``directory`` for this process; the file descriptor to close when done. Raises
    StorageError naming the holder (and ``hint``: what to do) when another process has it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StorageError(f"{what} {directory} is in use by {holder}; {hint}") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"the AgentENV server of pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def make_private(*directories: Path) -> None:
    """Only the server's user may enter these: they hold every sandbox's envd access token and
    env vars (the store, manifests), disk layers and memory files (a guest's RAM). Files in
    them keep their own modes (disk layers are read-only, 0444), the directory shuts the door."""
    for d in directories:
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
