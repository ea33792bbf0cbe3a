"""The stub kernel restored machines start with (vmm/kernel_stub.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.errors import VmmError
from agentenv.vmm.kernel_stub import restore_stub


def _bzimage(path: Path, setup_sects: int, payload: int) -> bytes:
    setup = bytearray(os.urandom((setup_sects + 1) * 512))
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    data = bytes(setup) + os.urandom(payload)
    path.write_bytes(data)
    return data


def test_stub_keeps_the_boot_header_and_drops_the_payload(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinuz-x"
    data = _bzimage(kernel, setup_sects=27, payload=4 << 20)
    stub = restore_stub(kernel)
    body = stub.read_bytes()
    assert body[:28 * 512] == data[:28 * 512]  # the setup sectors QEMU parses, unchanged
    assert len(body) == 28 * 512 + 4096 and not any(body[28 * 512:])
    assert restore_stub(kernel) == stub  # made once, then reused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restore-stub-vmlinuz-x", "vmlinuz-x"]


def test_a_file_that_is_not_a_bzimage_is_refused(tmp_path: Path) -> None:
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\x7fELF" + bytes(4096))
    with pytest.raises(VmmError, match="not a bzImage"):
        restore_stub(kernel)
    assert [p.name for p in tmp_path.iterdir()] == ["vmlinux"]


def test_provisioning_never_takes_the_stub_for_the_kernel(tmp_path: Path) -> None:
    from agentenv.images.kernel import ensure_kernel

    boot = tmp_path / "kernel" / "6.1.0-57-cloud-amd64" / "boot"
    boot.mkdir(parents=True)
    kernel = boot / "vmlinuz-6.1.0-57-cloud-amd64"
    _bzimage(kernel, setup_sects=27, payload=4096)
    restore_stub(kernel)
    assert ensure_kernel(tmp_path).vmlinuz == kernel
