"""Spare layer files: memory layers the garbage collector freed, kept to be written over.

A pause writes its memory layer with direct I/O into a new file. On ext4 most of that write's
cost is not the data but allocating the file's blocks as it grows (an extending direct write
journals the new extents and the size): overwriting a file whose blocks are already allocated
and written takes about 60 % of the time (25 MiB on the development machine's disk: ~12 ms
against ~19 ms). A rollout pauses and resumes over and over, and each resume frees the layer
its pause wrote; those files are kept here (up to a configured total) instead of unlinked, and
the next capture writes over one of them.

A freed layer becomes a spare only when nothing has it open (checked with a write lease once it
is renamed out of ``layers/``, so nothing can open it by name any more): a reader still holding
it, say a restore of a snapshot deleted meanwhile, keeps reading the bytes it started on.
Filesystems without leases (some shared ones) get no spares; the files are unlinked as before.
A spare's content is meaningless: a capture truncates it to the layer it wrote.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import uuid
from pathlib import Path

log = logging.getLogger(__name__)


class SparePool:
    """Files under ``root``, at most ``max_bytes`` together; thread-safe (captures and the gc
    run in worker threads)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)
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
        """Keep the freed layer ``path`` as a spare if it fits and nothing has it open, else
        unlink it. Either way it is gone from where it was."""
        if self.max_bytes <= 0:
            path.unlink(missing_ok=True)
            return
        dest = self.root / f"spare-{uuid.uuid4().hex[:12]}"
        try:
            size = path.stat().st_size
            with self._lock:
                room = sum(self._files.values()) + size <= self.max_bytes
            if not room:
                path.unlink(missing_ok=True)
                return
            os.rename(path, dest)  # no one opens it by its layer name from here on
        except FileNotFoundError:
            return
        if not _unused(dest):
            dest.unlink(missing_ok=True)
            return
        os.chmod(dest, 0o600)
        with self._lock:
            self._files[dest] = size
        self._trim()

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
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> int:
        """Unlink every spare (the disk is full: their space is needed); returns the bytes freed."""
        with self._lock:
            files, self._files = self._files, {}
        for p in files:
            p.unlink(missing_ok=True)
        if files:
            log.info("removed %d spare layer files (%d MiB) to free disk space", len(files),
                     sum(files.values()) >> 20)
        return sum(files.values())

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
    """No open file description of ``path`` but ours: a write lease is granted only then (it
    counts mappings, other processes' and this one's). False where leases are not supported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EINVAL, errno.ENOLCK, errno.EACCES):
            log.warning("cannot check whether %s is in use (%s); it is not kept as a spare", path, exc)
        return False
    finally:
        os.close(fd)
