"""The kernel a restored machine is started with: the guest kernel's boot header and nothing else.

QEMU reads the whole ``-kernel`` image into an anonymous buffer for the firmware and keeps it
for the life of the process: 14 MB of private memory per sandbox with Debian's cloud kernel,
as much as an idle guest's own RAM several times over. A machine started with ``-incoming``
never boots (its guest is already running in the state it loads, and ``-no-reboot`` makes a
guest reboot end QEMU), so it gets a stub: the bzImage's setup sectors, whose header QEMU
checks, plus one zero page of payload. Its initramfs is not needed either (see spec.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from agentenv.errors import VmmError

_HDRS_OFFSET = 0x202  # "HdrS": the Linux boot protocol's magic
_SETUP_SECTS_OFFSET = 0x1F1
_PAYLOAD = 4096


def restore_stub(kernel: Path) -> Path:
    """``restore-stub-<kernel name>`` next to the kernel, written (atomically) on first use.
    (Named so that nothing looking for ``vmlinuz-*`` takes it for a kernel.)"""
    stub = kernel.with_name("restore-stub-" + kernel.name)
    if stub.exists():
        return stub
    with open(kernel, "rb") as f:
        header = f.read(1024)
        if header[_HDRS_OFFSET:_HDRS_OFFSET + 4] != b"HdrS":
            raise VmmError(f"{kernel} is not a bzImage (no Linux boot header)")
        setup_size = ((header[_SETUP_SECTS_OFFSET] or 4) + 1) * 512
        f.seek(0)
        setup = f.read(setup_size)
    tmp = stub.with_name(f"{stub.name}.{os.getpid()}.tmp")
    tmp.write_bytes(setup + bytes(_PAYLOAD))
    os.replace(tmp, stub)
    return stub
