"""Spare layer files: memory layers the garbage collector freed, kept to be written over.

A pause writes its memory layer with direct I/O into a new file. On ext4 most of that write's
cost is not the data but allocating the file's blocks as it grows (an extending direct write
journals the new extents and the size): overwriting a file whose blocks are already allocated
and written takes about 60 % of the time (25 MiB on the development machine's disk: ~12 ms
against ~19 ms). Rollouts end by being killed, which frees the memory layers their pauses
wrote; those files are kept here (up to a configured total) instead of unlinked, and a later
capture writes over one of them.

A freed layer becomes a spare only when nothing on this host has it open and it has no other
name: it is renamed out of ``layers/`` (nothing can open it by its layer name any more), then
must have a link count of one and take a write lease, which the kernel grants only while no
other open file or mapping of it exists, in this process or another. A reader that still holds
it (say a restore of a snapshot deleted meanwhile) keeps the bytes it started on: the file is
unlinked instead. Spares are kept only on a local file system (another node reading a shared
repository is invisible to a lease) and only while the disk has room to spare; a disk running
short gets their space back. A spare's content is meaningless: a capture truncates it to the
layer it wrote.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import threading
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

# File systems on which a lease sees every opener of the file (this host's kernel).
LOCAL_FS = frozenset({"ext4", "ext3", "xfs", "btrfs", "tmpfs", "f2fs"})


class SparePool:
    """Files under ``root``, at most ``max_bytes`` together; thread-safe (captures and the gc
    run in worker threads). Off (every freed layer unlinked) on a file system that is not
    local, or when the process cannot take leases safely (see ``_leases_usable``)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        usable = max_bytes > 0 and _local(root) and _leases_usable()
        self.max_bytes = max_bytes if usable else 0
        self._lock = threading.Lock()
        self._files: dict[Path, int] = {}
        for p in root.iterdir():  # spares left by the last run are as good as new ones
            try:
                self._files[p] = p.stat().st_size
            except OSError:
                continue
        self._trim()

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._files.values())

    def offer(self, path: Path) -> None:
        """Keep the freed layer ``path`` as a spare if it fits, the disk has room to spare and
        nothing has it open; else unlink it. Either way it is gone from where it was. Never
        raises: the gc that calls it must go on."""
        dest = self.root / f"spare-{uuid.uuid4().hex[:12]}"
        try:
            size = path.stat().st_size
            if not (size <= self.max_bytes and self._disk_has_room()):
                path.unlink(missing_ok=True)
                return
            os.rename(path, dest)  # no one opens it by its layer name from here on
            if not _unused(dest):
                dest.unlink(missing_ok=True)
                return
            os.chmod(dest, 0o600)
            self._make_room(size)  # (only for a file that is kept)
        except OSError as exc:
            for p in (path, dest):
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
            if not isinstance(exc, FileNotFoundError):
                log.warning("freed layer %s not kept as a spare (%s)", path.name, exc)
            return
        with self._lock:
            self._files[dest] = size

    def take(self, out: Path, nbytes: int) -> bool:
        """Move a spare to ``out`` for a layer of about ``nbytes``: the smallest that holds it,
        else the largest. False when there is none."""
        with self._lock:
            if not self._files:
                return False
            fits = [p for p, s in self._files.items() if s >= nbytes]
            pick = (min(fits, key=self._files.__getitem__) if fits
                    else max(self._files, key=self._files.__getitem__))
            del self._files[pick]
        try:
            os.rename(pick, out)
            os.utime(out)  # a staging file's age is how the gc tells a leftover from one in use
        except OSError:
            pick.unlink(missing_ok=True)
            return False
        return True

    def clear(self) -> int:
        """Unlink every spare (the disk is short: their space is needed); returns the bytes
        freed. Every file in the folder goes, also one the bookkeeping lost."""
        with self._lock:
            self._files = {}
            freed = 0
            for p in list(self.root.iterdir()):
                try:
                    freed += p.stat().st_size
                    p.unlink()
                except OSError:
                    continue
        if freed:
            log.info("removed the spare layer files (%d MiB) to free disk space", freed >> 20)
        return freed

    def _make_room(self, size: int) -> None:
        """The oldest spares go for a newer one: the layers the node writes now are the best
        guide to those it will write next."""
        with self._lock:
            drop = []
            while self._files and sum(self._files.values()) + size > self.max_bytes:
                oldest = next(iter(self._files))
                del self._files[oldest]
                drop.append(oldest)
        for p in drop:
            p.unlink(missing_ok=True)

    def _disk_has_room(self) -> bool:
        """Keep spares only while the file system has at least twice the pool's size free:
        deleting snapshots on a full disk must free space, not fill the pool."""
        st = os.statvfs(self.root)
        if st.f_bavail * st.f_frsize >= 2 * self.max_bytes:
            return True
        self.clear()
        return False

    def _trim(self) -> None:
        """Down to ``max_bytes`` (the setting may have shrunk since the last run), largest first."""
        with self._lock:
            drop = []
            while self._files and sum(self._files.values()) > self.max_bytes:
                p = max(self._files, key=self._files.__getitem__)
                del self._files[p]
                drop.append(p)
        for p in drop:
            p.unlink(missing_ok=True)


def _unused(path: Path) -> bool:
    """Its only name is ``path`` and no open file description of it exists but ours: a write
    lease is granted only then (it counts mappings, other processes' and this one's)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_nlink != 1:  # a hard link elsewhere could be opened later
            return False
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EINVAL, errno.ENOLCK, errno.EACCES):
            log.warning("cannot check whether %s is in use (%s); it is not kept as a spare", path, exc)
        return False
    finally:
        os.close(fd)


def _leases_usable() -> bool:
    """While a lease is held, an open of the file by anyone sends the holder SIGIO, whose
    default action ends the process. It is ignored here (nothing else in the server uses it);
    a process that cannot (not on its main thread) keeps no spares."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGIO, signal.SIG_IGN)
    return signal.getsignal(signal.SIGIO) == signal.SIG_IGN


def _local(path: Path) -> bool:
    """Whether ``path`` is on a local file system of LOCAL_FS (by /proc/self/mounts)."""
    best, fstype = "", ""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return False
    return fstype in LOCAL_FS
