"""``provision()`` and `aenv setup` with the expensive steps faked (no apt, no downloads, no VM).

Checks the contract the server relies on: ``<cache>/default.json`` names the three artifacts
(read back by ``artifacts_present``), stale base images go, and a second run changes nothing
and says so.
"""

from __future__ import annotations

import json

import pytest

from agentenv.images import artifacts_present
from agentenv.images import provision as prov
from agentenv.images.kernel import Kernel
from agentenv.images.provision import STEPS, provision


@pytest.fixture
def fake_builds(monkeypatch):
    """ensure_* replaced by functions that create small files the way the real ones name them."""
    built = []

    def kernel(cache):
        vmlinuz = cache / "kernel" / "6.1-test" / "boot" / "vmlinuz-6.1-test"
        if not vmlinuz.exists():
            vmlinuz.parent.mkdir(parents=True)
            vmlinuz.write_bytes(b"k")
            built.append("kernel")
        return Kernel("6.1-test", vmlinuz, vmlinuz.parents[1] / "lib/modules")

    def initramfs(cache, _kernel):
        out = cache / "initramfs" / "initramfs-aaa.cpio"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"i")
            built.append("initramfs")
        return out

    def rootfs(cache):
        out = cache / "rootfs" / "base-new.ext4"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"r")
            built.append("rootfs")
        return out

    def tools(cache, _tarball):
        out = cache / "tools" / "tools-aaa.ext4"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"t")
            built.append("tools")
        return out

    monkeypatch.setattr(prov, "ensure_kernel", kernel)
    monkeypatch.setattr(prov.rootfs, "debian_tarball", lambda cache: cache / "rootfs" / "debian-test.tar")
    monkeypatch.setattr(prov.toolsdrive, "ensure_tools_drive", tools)
    monkeypatch.setattr(prov, "ensure_initramfs", initramfs)
    monkeypatch.setattr(prov.rootfs, "ensure_base_rootfs", rootfs)
    return built


def test_provision_writes_the_manifest_and_is_idempotent(tmp_path, fake_builds):
    cache = tmp_path / "cache"
    (cache / "rootfs").mkdir(parents=True)
    (cache / "rootfs" / "base-old.ext4").write_bytes(b"old")
    lines: list[str] = []
    artifacts = provision(cache, apt=False, progress=lines.append)
    assert len(lines) == len(STEPS) + 1
    assert [line.split(":")[0] for line in lines[:-1]] == list(STEPS)
    assert fake_builds == ["kernel", "initramfs", "rootfs", "tools"]
    assert json.loads((cache / "default.json").read_text()) == artifacts.to_json()
    assert artifacts_present(cache) == artifacts
    assert not (cache / "rootfs" / "base-old.ext4").exists()
    assert "removed 1 old image" in lines[6]
    assert lines[-1].startswith("guest images ready")

    again: list[str] = []
    assert provision(cache, apt=False, progress=again.append) == artifacts
    assert fake_builds == ["kernel", "initramfs", "rootfs", "tools"]
    assert all("cached" in again[i] for i in (1, 2, 3, 4)) and "unchanged" in again[5]
    assert again[-1].startswith("everything was already provisioned")
    assert not list(cache.glob(".default.json*"))  # no temp file left behind


def test_setup_command_renders_every_step(tmp_path, fake_builds, aenv):
    args = ["setup", "--skip-apt", "--cache-dir", str(tmp_path / "c")]
    first = aenv(*args)
    assert first.exit_code == 0, first.output
    for title in STEPS:
        assert title in first.stdout
    assert "guest images ready" in first.stdout
    second = aenv(*args)
    assert second.exit_code == 0
    assert "everything was already provisioned" in second.stdout


def test_setup_failure_names_the_step(tmp_path, fake_builds, monkeypatch, aenv):
    from agentenv.errors import ProvisioningError

    def broken(_cache, _kernel):
        raise ProvisioningError("busybox-static is not installed")

    monkeypatch.setattr(prov, "ensure_initramfs", broken)
    res = aenv("setup", "--skip-apt", "--cache-dir", str(tmp_path / "c"))
    assert res.exit_code == 1
    assert "initramfs failed" in res.stdout
    assert res.stderr == "error: busybox-static is not installed\n"


def test_missing_packages_asks_dpkg(monkeypatch):
    class Res:
        stdout = "cpio install ok installed\nnftables deinstall ok config-files\n"

    monkeypatch.setattr(prov.subprocess, "run", lambda *a, **k: Res())
    assert prov.missing_packages(("cpio", "nftables", "qemu-utils")) == ["nftables", "qemu-utils"]
