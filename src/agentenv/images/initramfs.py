"""The initramfs: busybox-static plus the kernel's virtio modules and our stage-1 init."""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from agentenv.durable import publish
from agentenv.errors import ProvisioningError
from agentenv.images.artifacts import inputs_hash
from agentenv.images.kernel import Kernel
from agentenv.proc import run_sync

# Load order matters: dependencies first (busybox insmod does not resolve them).
MODULES = {
    "virtio_ring": "drivers/virtio/virtio_ring.ko",
    "virtio": "drivers/virtio/virtio.ko",
    "virtio_mmio": "drivers/virtio/virtio_mmio.ko",
    "virtio_blk": "drivers/block/virtio_blk.ko",
    "failover": "../kernel/net/core/failover.ko",
    "net_failover": "drivers/net/net_failover.ko",
    "virtio_net": "drivers/net/virtio_net.ko",
    "virtio_console": "drivers/char/virtio_console.ko",
    "virtio-rng": "drivers/char/hw_random/virtio-rng.ko",
}
BUSYBOX = Path("/bin/busybox")


def ensure_initramfs(cache: Path, kernel: Kernel) -> Path:
    """Build (once per kernel + init script) an uncompressed newc cpio."""
    init_script = resources.files("agentenv.guest").joinpath("initramfs-init.sh").read_bytes()
    if not BUSYBOX.exists():
        raise ProvisioningError("busybox-static is not installed (/bin/busybox missing); run `aenv setup`")
    out = cache / "initramfs" / f"initramfs-{inputs_hash(kernel.version, init_script, BUSYBOX.read_bytes())}.cpio"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for d in ("bin", "dev", "proc", "sys", "tmp", "run", "mnt", "newroot", "lib/modules", "etc"):
            (root / d).mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX, root / "bin/busybox")
        (root / "init").write_bytes(init_script)
        os.chmod(root / "init", 0o755)
        for name, rel in MODULES.items():
            src = (kernel.modules / rel).resolve()
            if not src.exists():
                raise ProvisioningError(f"kernel module {name} not found at {src}")
            shutil.copy2(src, root / "lib/modules" / f"{name}.ko")
        tmp_out = out.with_suffix(".tmp")
        run_sync(["sh", "-c", f"find . | cpio -o -H newc --quiet > {tmp_out}"], cwd=str(root))
        publish(tmp_out, out)
    return out
