"""Host provisioning: everything `aenv setup` does, as one plain, idempotent function.

It lives here (not in the CLI) so tests and other tools can provision without typer or rich;
the CLI only renders the progress lines. Every step is cached by the ``ensure_*`` functions it
calls, so a second run only checks and reports "cached".
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agentenv.errors import ExternalCommandError, ProvisioningError
from agentenv.images import rootfs, toolsdrive
from agentenv.images.artifacts import GuestArtifacts
from agentenv.images.initramfs import ensure_initramfs
from agentenv.images.kernel import Kernel, ensure_kernel

HOST_PACKAGES = (
    "qemu-system-x86", "qemu-utils", "busybox-static", "mmdebstrap", "e2fsprogs", "iproute2", "nftables", "cpio",
    "patchelf", "skopeo", "umoci", "gcc", "libc6-dev",
)

# Titles of the steps, in order. ``progress`` is called once after each of them with a line
# "<title>: <what was done> (<seconds>s)", then once more with a summary line.
STEPS = (
    "Debian packages",
    "guest kernel",
    "initramfs",
    "base root filesystem",
    "tools drive",
    "default.json manifest",
    "stale base images",
)

Progress = Callable[[str], None]
T = TypeVar("T")


def provision(cache: Path, *, apt: bool = True, progress: Progress | None = None) -> GuestArtifacts:
    """Install host packages, build kernel/initramfs/rootfs, write ``<cache>/default.json``.

    ``apt=False`` skips apt-get (the packages must then already be there). Raises
    ProvisioningError or ExternalCommandError with a message saying what to fix.
    """
    report = progress or (lambda _line: None)
    cache = cache.absolute()  # default.json must hold absolute paths
    cache.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    changed = False
    apt_state = {"updated": False}

    def step(title: str, fn: Callable[[], tuple[T, str, bool]]) -> T:
        """Run one step; ``fn`` returns (value, what it did, whether anything changed)."""
        nonlocal changed
        t0 = time.monotonic()
        value, detail, did = fn()
        changed = changed or did
        report(f"{title}: {detail} ({time.monotonic() - t0:.1f}s)")
        return value

    step(STEPS[0], lambda: _packages(apt, apt_state))
    kernel = step(STEPS[1], lambda: _kernel(cache, apt, apt_state))
    initramfs = step(STEPS[2], lambda: _built(cache / "initramfs", "initramfs-*.cpio",
                                              lambda: ensure_initramfs(cache, kernel)))
    base = step(STEPS[3], lambda: _built(cache / "rootfs", "base-*.ext4", lambda: rootfs.ensure_base_rootfs(cache)))
    tools = step(STEPS[4], lambda: _built(cache / "tools", "tools-*.ext4", lambda: toolsdrive.ensure_tools_drive(
        cache, rootfs.debian_tarball(cache))))
    artifacts = GuestArtifacts(kernel=kernel.vmlinuz, initramfs=initramfs, rootfs=base, tools=tools)
    step(STEPS[5], lambda: _manifest(cache, artifacts))
    step(STEPS[6], lambda: _remove_stale(cache, base, tools))
    total = time.monotonic() - start
    report(f"guest images ready in {total:.1f}s" if changed
           else f"everything was already provisioned; nothing to do ({total:.1f}s)")
    return artifacts


def missing_packages(packages: tuple[str, ...] = HOST_PACKAGES) -> list[str]:
    """Packages dpkg does not report as ``install ok installed``."""
    try:
        res = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Status}\n", *packages],
                             capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise ProvisioningError("dpkg-query not found: `aenv setup` needs a Debian/Ubuntu host "
                                "(or pass --skip-apt and install the packages yourself)") from exc
    installed = set()
    for line in res.stdout.splitlines():
        name, _, status = line.partition(" ")
        if status.strip() == "install ok installed":
            installed.add(name.split(":")[0])
    return [p for p in packages if p not in installed]


def _apt(args: list[str]) -> None:
    argv = ["apt-get", *args]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    if res.returncode != 0:
        raise ExternalCommandError(argv, res.returncode, res.stdout.decode(errors="replace"))


def _packages(apt: bool, apt_state: dict[str, bool]) -> tuple[None, str, bool]:
    if not apt:
        return None, "skipped (--skip-apt)", False
    missing = missing_packages()
    if not missing:
        return None, f"all {len(HOST_PACKAGES)} already installed", False
    if os.geteuid() != 0:
        raise ProvisioningError(f"installing {', '.join(missing)} needs root; run `sudo aenv setup` "
                                "or install them yourself and pass --skip-apt")
    _apt(["update", "-q"])
    apt_state["updated"] = True
    _apt(["install", "-y", "-q", *missing])
    return None, f"installed {', '.join(missing)}", True


def _kernel(cache: Path, apt: bool, apt_state: dict[str, bool]) -> tuple[Kernel, str, bool]:
    kdir = cache / "kernel"
    cached = kdir.exists() and any(kdir.glob("*/boot/vmlinuz-*"))
    try:
        k = ensure_kernel(cache)
    except ProvisioningError:
        # `apt-cache depends` needs package lists; a fresh host may have none even when every
        # host package is installed (apt-get update was skipped above).
        if not apt or apt_state["updated"] or os.geteuid() != 0:
            raise
        _apt(["update", "-q"])
        apt_state["updated"] = True
        k = ensure_kernel(cache)
    return k, (f"cached {k.version}" if cached else f"downloaded {k.version}"), not cached


def _built(folder: Path, pattern: str, build: Callable[[], Path]) -> tuple[Path, str, bool]:
    before = set(folder.glob(pattern)) if folder.exists() else set()
    path = build()
    return path, (f"cached {path.name}" if path in before else f"built {path.name}"), path not in before


def _manifest(cache: Path, artifacts: GuestArtifacts) -> tuple[None, str, bool]:
    manifest = cache / "default.json"
    text = json.dumps(artifacts.to_json(), indent=2) + "\n"
    try:
        if manifest.read_text() == text:
            return None, f"unchanged ({manifest})", False
    except (OSError, ValueError):
        pass
    tmp = manifest.with_name(f".default.json.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, manifest)
    return None, f"wrote {manifest}", True


def _remove_stale(cache: Path, keep: Path, tools: Path) -> tuple[None, str, bool]:
    def images() -> set[Path]:
        return set((cache / "rootfs").glob("base-*.ext4")) | set((cache / "tools").glob("tools-*.ext4"))
    before = images()
    rootfs.remove_stale(cache, keep={keep})
    toolsdrive.remove_stale(cache, keep={tools})
    removed = len(before - images())
    return None, (f"removed {removed} old image{'s' if removed != 1 else ''}" if removed else "none"), removed > 0
