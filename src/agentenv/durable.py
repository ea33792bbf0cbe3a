"""Making a write survive a host crash, not only a server crash: what is published by a
rename must be on the disk before the rename is, and the rename itself needs its directory
fsynced. Without both, a power loss can leave a name that points at an empty or torn file."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dest: Path) -> None:
    """Rename a finished file into place durably: its data first, then the rename."""
    fsync_path(tmp)
    os.replace(tmp, dest)
    fsync_path(dest.parent)
