"""The files that make a template snapshot: memory file + device state + sealed disk overlay.

A template snapshot is taken once per (template, vCPUs, memory) shape by cold-booting the
template until its agent answers. Creating a sandbox then never boots: a new QEMU maps the
memory file copy-on-write and loads the device state (qemu-microvm-notes.md §4–5).

    <dir>/disk.qcow2   sealed overlay over the template's base image (read-only)
    <dir>/state        device state (x-ignore-shared migration stream, tens of KB)
    <dir>/memory       a sparse copy of the guest RAM on the data disk (survives a host reboot)
    <dir>/meta.json    what was snapshotted, written last: its presence marks completion
    <mem_file>         guest RAM on tmpfs, shared by every sandbox of this shape

tmpfs is empty after a host reboot. Paused sandboxes and named snapshots hold only the pages
they changed and build on this exact snapshot (its memory, device state and disk), so the
memory file is brought back from ``<dir>/memory`` instead of snapshotting the template again.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from agentenv.durable import fsync_path, publish
from agentenv.storage.memory_layers import materialize

TMP_SUFFIX = ".tmp"  # memory files being copied back; left behind only by a crash
_COPIES: dict[Path, threading.Lock] = {}  # ensure_memory: one copy at a time per memory file
_COPIES_GUARD = threading.Lock()


@dataclass(frozen=True)
class TemplateSnapshot:
    template: str
    dir: Path
    mem_file: Path
    memory_mb: int
    vcpus: int
    kernel: str
    initramfs: str
    rootfs: str
    created_at: float
    tools: str = ""  # the tools drive the guest runs its agent from (its version is in the name)
    boot_ms: float = 0.0
    snapshot_ms: float = 0.0
    # QEMU's -cpu under TCG when it was made; every restore of it and of what builds on it
    # (pauses, snapshots, forks) must use the same. Snapshots from before the field: "max".
    tcg_cpu: str = "max"

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    @property
    def memory_copy(self) -> Path:
        return self.dir / "memory"

    def keep_memory(self) -> None:
        """Write the durable copy of the memory file (right after the build, or once for a
        snapshot made before copies were kept; blocking). Durable before it is relied on."""
        tmp = self.dir / "memory.tmp"
        materialize(self.mem_file, [], tmp)
        publish(tmp, self.memory_copy)

    def ensure_memory(self) -> None:
        """Bring the memory file back onto tmpfs from the durable copy if it is gone (blocking:
        a sparse copy of the pages the template touched, once after a host reboot). One copy
        at a time per file: after a reboot a trainer resumes dozens of sandboxes at once, and
        each made its own copy on tmpfs (RAM no admission counted) before one was linked in."""
        if self.mem_file.exists():
            return
        with _COPIES_GUARD:
            lock = _COPIES.setdefault(self.mem_file, threading.Lock())
        with lock:
            if self.mem_file.exists():  # the caller before us copied it
                return
            self.mem_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.mem_file.with_name(f"{self.mem_file.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}")
            try:
                materialize(self.memory_copy, [], tmp)
                try:
                    os.link(tmp, self.mem_file)
                except FileExistsError:
                    pass  # another process was first
            finally:
                tmp.unlink(missing_ok=True)

    def save(self) -> None:
        """Write ``meta.json``, the mark of a complete snapshot, once what it names is on the
        disk (blocking): torn after a power cut, the device state or disk would fail every
        create of the template, and a lost mark would rebuild it under a new time, refusing
        every paused sandbox and snapshot taken on this one."""
        for name in ("state", "disk.qcow2"):
            if (self.dir / name).exists():
                fsync_path(self.dir / name)
        d = asdict(self)
        d["dir"] = str(self.dir)
        d["mem_file"] = str(self.mem_file)
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(d, indent=1))
        publish(tmp, self.dir / "meta.json")

    @classmethod
    def load(cls, dir: Path) -> TemplateSnapshot | None:
        """The snapshot in ``dir`` if it is complete: device state, disk, and its memory file
        or the durable copy of it (``ensure_memory`` brings the file back before use)."""
        try:
            d = json.loads((dir / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        d["dir"] = Path(d["dir"])
        d["mem_file"] = Path(d["mem_file"])
        snap = cls(**d)
        if not ((snap.mem_file.exists() or snap.memory_copy.exists()) and snap.state.exists() and snap.disk.exists()):
            return None
        return snap

