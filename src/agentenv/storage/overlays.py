"""qcow2 overlays: every sandbox writes into its own thin overlay over a shared read-only base."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

from agentenv.errors import DiskFull, ExternalCommandError, StorageError
from agentenv.proc import run


async def create_overlay(path: Path, backing: Path, backing_format: str) -> Path:
    """Create ``path`` as a qcow2 overlay of ``backing``. A full disk raises DiskFull and
    leaves no file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return await _qemu_img_create(path, ["-b", str(backing), "-F", backing_format], None, "a disk overlay")


# ``qemu-img create`` ends with an fdatasync of the new file. On ext4 that forces a journal
# commit, which first writes back other files' dirty data: measured 1.2 s behind the fsync of a
# 1 GiB layer, inside a snapshot's stop window, and on every create while sandboxes write to
# their disks. The overlay is made on tmpfs, where the fdatasync costs nothing, and copied into
# place (~200 KB). It needs no durability of its own: QEMU writes to it with cache=unsafe.
STAGING = Path("/dev/shm")


async def _qemu_img_create(path: Path, opts: list[str], size: str | None, what: str) -> Path:
    """``qemu-img create -f qcow2 <opts> path [size]``; a failure leaves no file behind and a
    full disk is DiskFull."""
    staging = Path(tempfile.mkdtemp(prefix="aenv-qcow2-", dir=STAGING if STAGING.is_dir() else path.parent))
    made = staging / path.name
    try:
        await run(["qemu-img", "create", "-q", "-f", "qcow2", *opts, str(made), *([size] if size else [])])
        await asyncio.to_thread(shutil.copyfile, made, path)
    except ExternalCommandError as exc:
        if "No space left" in exc.output:
            raise DiskFull(f"no space left on {staging.parent} for {what}; free space there") from exc
        raise StorageError(f"cannot create overlay {path}: {exc.output.strip()}") from exc
    except OSError as exc:
        path.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFull(f"no space left on {path.parent} for {what}; free disk space") from exc
        raise StorageError(f"cannot write overlay {path}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def remove_stale_staging(max_age_s: float = 600.0) -> list[str]:
    """Staging folders a process killed mid-create left on tmpfs (one lives well under a
    second). Blocking."""
    removed = []
    for d in STAGING.glob("aenv-qcow2-*") if STAGING.is_dir() else ():
        try:
            if time.time() - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
        except OSError:
            continue
    return removed


def seal_readonly(path: Path) -> None:
    """A base that overlays depend on must never change again."""
    os.chmod(path, 0o444)


async def remove_tree(path: Path) -> None:
    """Remove a sandbox's directory off the event loop (overlays can be large)."""
    await asyncio.to_thread(shutil.rmtree, path, True)


async def create_overlay_over(path: Path, backing: Path, size_mb: int) -> Path:
    """A new qcow2 over a sealed layer without opening it (``-u``): used in the stop window of
    a snapshot, where the backing file is open in the running QEMU."""
    return await _qemu_img_create(path, ["-u", "-b", str(backing), "-F", "qcow2"], f"{size_mb}M", "a new disk layer")


def backing_chain(path: Path) -> list[Path]:
    """The backing files below a qcow2 overlay, nearest first, read from the qcow2 headers
    (no process, so the repository's GC can afford it for every sandbox). Stops at a file
    that does not exist; raises StorageError for one that cannot be read."""
    out: list[Path] = []
    current = path
    for _ in range(256):
        try:
            with open(current, "rb") as f:
                head = f.read(32)
                if head[:4] != b"QFI\xfb":
                    break
                offset = int.from_bytes(head[8:16], "big")
                size = int.from_bytes(head[16:20], "big")
                if not offset or not size:
                    break
                f.seek(offset)
                name = f.read(size).decode()
        except FileNotFoundError:
            break
        except OSError as exc:  # not "no chain": the gc must not collect what it could not read
            raise StorageError(f"the disk chain under {path} cannot be read at {current}: {exc}") from exc
        nxt = Path(name) if name.startswith("/") else current.parent / name
        out.append(nxt)
        current = nxt
    return out
