"""The files that make a template snapshot: memory file + device state + sealed disk overlay.

A template snapshot is taken once per (template, vCPUs, memory) shape by cold-booting the
template until its agent answers. Creating a sandbox then never boots: a new QEMU maps the
memory file copy-on-write and loads the device state (qemu-microvm-notes.md §4–5).

    <dir>/disk.qcow2   sealed overlay over the template's base image (read-only)
    <dir>/state        device state (x-ignore-shared migration stream, tens of KB)
    <dir>/meta.json    what was snapshotted, written last: its presence marks completion
    <mem_file>         guest RAM on tmpfs, shared by every sandbox of this shape
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


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

    @property
    def disk(self) -> Path:
        return self.dir / "disk.qcow2"

    @property
    def state(self) -> Path:
        return self.dir / "state"

    def save(self) -> None:
        d = asdict(self)
        d["dir"] = str(self.dir)
        d["mem_file"] = str(self.mem_file)
        tmp = self.dir / "meta.json.tmp"
        tmp.write_text(json.dumps(d, indent=1))
        os.replace(tmp, self.dir / "meta.json")

    @classmethod
    def load(cls, dir: Path) -> TemplateSnapshot | None:
        """The snapshot in ``dir`` if it is complete and its memory file still exists (tmpfs
        is empty after a host reboot, so the template must be snapshotted again)."""
        try:
            d = json.loads((dir / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        d["dir"] = Path(d["dir"])
        d["mem_file"] = Path(d["mem_file"])
        snap = cls(**d)
        if not (snap.mem_file.exists() and snap.state.exists() and snap.disk.exists()):
            return None
        return snap
