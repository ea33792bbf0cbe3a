"""The set of files a VM boots from, as the rest of the system sees them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GuestArtifacts:
    """Kernel + initramfs + tools drive (agent and its Python) + read-only ext4 base of one
    template. The first three are shared by every template; the base is the template's image."""

    kernel: Path
    initramfs: Path
    rootfs: Path
    tools: Path

    def to_json(self) -> dict[str, str]:
        return {"kernel": str(self.kernel), "initramfs": str(self.initramfs), "rootfs": str(self.rootfs),
                "tools": str(self.tools)}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> GuestArtifacts:
        return cls(Path(d["kernel"]), Path(d["initramfs"]), Path(d["rootfs"]), Path(d.get("tools", "/nonexistent")))


def artifacts_present(cache: Path) -> GuestArtifacts | None:
    """The provisioned default artifacts, or None when `aenv setup` has not run."""
    manifest = cache / "default.json"
    if not manifest.exists():
        return None
    a = GuestArtifacts.from_json(json.loads(manifest.read_text()))
    if all(p.exists() for p in (a.kernel, a.initramfs, a.rootfs, a.tools)):
        return a
    return None


def remove_read_only(path: Path) -> None:
    """Delete an image file built 0444 (base images, tools drives, converted OCI images)."""
    try:
        path.chmod(0o644)
    except FileNotFoundError:
        return
    path.unlink(missing_ok=True)


def remove_images_except(folder: Path, pattern: str, keep: set[Path]) -> None:
    """Delete the images in ``folder`` matching ``pattern`` that ``keep`` does not name: builds
    superseded by a change of their inputs."""
    for p in folder.glob(pattern):
        if p not in keep:
            remove_read_only(p)


def inputs_hash(*parts: bytes | str) -> str:
    """Short content hash of a build's inputs, used in artifact file names."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:12]
