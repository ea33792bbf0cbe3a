"""The tools drive runs the guest agent in an image that has nothing of ours: here a root with
only a static busybox (no libc, no Python), entered with chroot as the guest's init does after
switch_root. No VM needed: the drive is an ext4 image, mounted read-only on a loop device."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agentenv.bench.node import free_port
from agentenv.envd_client import CommandResult, EnvdClient
from agentenv.images import toolsdrive
from agentenv.images.rootfs import debian_tarball

CACHE = Path(os.environ.get("AENV_CACHE_DIR", "/var/lib/agentenv/cache"))


@pytest.fixture(scope="module")
def drive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tarball = debian_tarball(CACHE)  # built by `aenv setup`; cached
    return toolsdrive.ensure_tools_drive(tmp_path_factory.mktemp("cache"), tarball)


@pytest.fixture
def busybox_root(tmp_path: Path, drive: Path):
    """A root file system holding only /bin/busybox, with the drive at /run/agentenv."""
    root = tmp_path / "root"
    for d in ("bin", "dev", "etc", "proc", "tmp", "run/agentenv", "home/user"):
        (root / d).mkdir(parents=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    (root / "bin" / "sh").symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    os.chown(root / "home" / "user", 1000, 1000)
    yield root


def _in_root(root: Path, drive: Path, script: str, **kw) -> subprocess.Popen:
    """Run ``script`` (host sh) in a private mount namespace where the drive is mounted."""
    setup = (f"mount -o ro,loop {drive} {root}/run/agentenv && mount -t proc proc {root}/proc && "
             f"mount -t tmpfs tmpfs {root}/tmp && touch {root}/dev/null && mount --bind /dev/null {root}/dev/null && "
             f"{script}")
    return subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", setup], **kw)


def test_drive_is_versioned_read_only_and_cached(drive: Path) -> None:
    assert drive.name == f"tools-{toolsdrive.version_of(drive)}.ext4"
    assert drive.stat().st_mode & 0o777 == 0o444
    again = toolsdrive.ensure_tools_drive(drive.parent.parent, debian_tarball(CACHE))
    assert again == drive


def test_python_of_the_drive_runs_where_there_is_no_libc(busybox_root: Path, drive: Path) -> None:
    code = "import ssl, ctypes, json, asyncio, pty, sqlite3, sys; print(sys.prefix, ssl.OPENSSL_VERSION_INFO[0])"
    p = _in_root(busybox_root, drive, f"chroot {busybox_root} /run/agentenv/python/bin/python3 -E -s -S -c '{code}'",
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.split() == ["/run/agentenv/python", "3"]


def test_agent_serves_commands_in_a_busybox_only_image(busybox_root: Path, drive: Path) -> None:
    port = free_port()
    agent = _in_root(busybox_root, drive,
                     f"exec chroot {busybox_root} /run/agentenv/python/bin/python3 -E -s -S -u "
                     f"/run/agentenv/agent/agent.py --host 127.0.0.1 --port {port} --tools /run/agentenv",
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 204:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and agent.poll() is None, agent.stderr.read().decode()
            time.sleep(0.1)
        # What the SDKs send: /bin/bash -l -c. The image has no bash: its /bin/sh runs it, as `user`
        # (switched by the drive's spawn library).
        res = asyncio.run(_run(url, ["/bin/bash", "-l", "-c", "id -u; echo $HOME; pwd"]))
        assert res.exit_code == 0 and res.stdout == b"1000\n/home/user\n/home/user\n", res
    finally:
        agent.terminate()
        agent.wait(timeout=10)


async def _run(url: str, argv: list[str]) -> CommandResult:
    async with EnvdClient(url) as envd:
        return await envd.run(argv, user="user")
