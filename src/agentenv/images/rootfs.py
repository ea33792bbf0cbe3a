"""Template root filesystems: a Debian bookworm tree from mmdebstrap, packed as read-only ext4.

Two cached stages:
1. ``debian-<hash>.tar``: mmdebstrap output, keyed by suite + package list (the tools drive
   takes its Python from the same tree, see toolsdrive.py);
2. ``base-<hash>.ext4``: that tree as a file system. Nothing of ours is in it: the agent runs
   from the tools drive, as it does for every image.
The ext4 file is chmod 444: it is the shared backing file of every sandbox overlay.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from agentenv.durable import publish
from agentenv.images.artifacts import inputs_hash, remove_images_except
from agentenv.proc import run_sync

SUITE = "bookworm"
BASE_PACKAGES = (
    "bash", "coreutils", "python3", "curl", "git", "sudo", "ncurses-bin", "ca-certificates",
    "iproute2", "procps", "less", "xz-utils", "attr",
)
DISK_SIZE_MB = 4096


def _debian_tarball(cache: Path, packages: tuple[str, ...]) -> Path:
    out = cache / "rootfs" / f"debian-{SUITE}-{inputs_hash(SUITE, *sorted(packages))}.tar"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial.tar")
    hooks = [
        # A normal user with passwordless sudo, as E2B's base template has.
        '--customize-hook=chroot "$1" useradd -m -s /bin/bash -u 1000 user',
        '--customize-hook=echo "user ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/user"',
        '--customize-hook=chmod 440 "$1/etc/sudoers.d/user"',
        '--customize-hook=echo sandbox > "$1/etc/hostname"',
        '--customize-hook=printf "127.0.0.1 localhost\\n127.0.1.1 sandbox\\n" > "$1/etc/hosts"',
    ]
    run_sync(
        ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(packages)}",
         "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
         "--dpkgopt=path-exclude=/usr/share/locale/*", *hooks, SUITE, str(tmp)]
    )
    publish(tmp, out)
    return out


def debian_tarball(cache: Path, packages: tuple[str, ...] = BASE_PACKAGES) -> Path:
    """The Debian tree of the default template (also the source of the tools drive's Python)."""
    return _debian_tarball(cache, packages)


def ensure_base_rootfs(cache: Path, packages: tuple[str, ...] = BASE_PACKAGES, size_mb: int = DISK_SIZE_MB) -> Path:
    """The read-only ext4 base image of the default template, built when its inputs change."""
    tarball = _debian_tarball(cache, packages)
    key = inputs_hash(tarball.name, str(size_mb), "no-agent", "profile-euid")
    out = cache / "rootfs" / f"base-{key}.ext4"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=cache / "rootfs") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        run_sync(["tar", "-xf", str(tarball), "-C", str(tree)])
        _login_shell_without_fork(tree / "etc" / "profile")
        img = Path(tmp) / "base.ext4"
        run_sync(["mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-O", "has_journal",
                  "-E", "lazy_itable_init=1,lazy_journal_init=1", "-d", str(tree), str(img), f"{size_mb}M"])
        os.chmod(img, 0o444)
        publish(img, out)
    return out


def _login_shell_without_fork(profile: Path) -> None:
    """Debian's /etc/profile asks ``$(id -u)`` whether the user is root: a fork and an exec on
    every login shell, and every SDK command is one (``bash -l -c``). Under TCG that is
    a large part of the shell's start-up. bash knows the answer (``$EUID``); other shells
    still ask ``id``."""
    text = profile.read_text()
    profile.write_text(text.replace('"$(id -u)"', '"${EUID:-$(id -u)}"'))


def remove_stale(cache: Path, keep: set[Path]) -> None:
    """Delete older base images so the cache does not grow with every agent change."""
    remove_images_except(cache / "rootfs", "base-*.ext4", keep)
    shutil.rmtree(cache / "rootfs" / "tmp", ignore_errors=True)
