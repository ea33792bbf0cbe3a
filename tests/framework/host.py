"""What a node leaves on the host: QEMU processes, namespaces, run dirs. Tests diff these."""

from __future__ import annotations

import subprocess
from pathlib import Path


def qemu_pids(marker: str) -> set[int]:
    """Pids of QEMU processes whose command line contains ``marker`` (a data dir or an id)."""
    out = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"qemu-system") and marker.encode() in cmd:
            out.add(int(p.name))
    return out


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def sandbox_dirs(data_dir: Path) -> set[str]:
    d = data_dir / "sandboxes"
    return {p.name for p in d.iterdir()} if d.exists() else set()
