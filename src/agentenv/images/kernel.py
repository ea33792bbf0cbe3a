"""The guest kernel: Debian's cloud kernel, fetched with apt-get download.

The cloud flavour is small and has ext4 built in; its virtio drivers are modules, which the
initramfs loads (see initramfs.py).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentenv.errors import ProvisioningError
from agentenv.proc import run_sync

META_PACKAGE = "linux-image-cloud-amd64"


@dataclass(frozen=True)
class Kernel:
    version: str  # e.g. 6.1.0-57-cloud-amd64
    vmlinuz: Path
    modules: Path  # lib/modules/<version>/kernel


def resolve_kernel_package() -> str:
    """The versioned image package the cloud meta-package depends on."""
    out = run_sync(["apt-cache", "depends", META_PACKAGE], check=False)
    m = re.search(r"Depends:\s*(linux-image-[\w.+-]+-cloud-amd64)", out)
    if not m:
        raise ProvisioningError(
            f"cannot resolve {META_PACKAGE} with apt-cache (run `apt-get update` first): {out.strip()[:300]}"
        )
    return m.group(1)


def ensure_kernel(cache: Path) -> Kernel:
    """Download and unpack the kernel package once; later calls return the cached copy."""
    kdir = cache / "kernel"
    existing = sorted(kdir.glob("*/boot/vmlinuz-*")) if kdir.exists() else []
    if existing:
        vmlinuz = existing[-1]
        version = vmlinuz.name.removeprefix("vmlinuz-")
        return Kernel(version, vmlinuz, vmlinuz.parents[1] / "lib/modules" / version / "kernel")
    pkg = resolve_kernel_package()
    version = pkg.removeprefix("linux-image-")
    kdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=kdir) as tmp:
        shutil.chown(tmp, "_apt") if _user_exists("_apt") else None
        run_sync(["apt-get", "download", "-q", pkg], cwd=tmp)
        debs = list(Path(tmp).glob("*.deb"))
        if not debs:
            raise ProvisioningError(f"apt-get download {pkg} produced no .deb")
        root = Path(tmp) / "root"
        run_sync(["dpkg-deb", "-x", str(debs[0]), str(root)])
        final = kdir / version
        if final.exists():
            shutil.rmtree(final)
        root.rename(final)
    vmlinuz = final / "boot" / f"vmlinuz-{version}"
    return Kernel(version, vmlinuz, final / "lib/modules" / version / "kernel")


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
