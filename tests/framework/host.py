"""What a node leaves on the host: QEMU processes, namespaces, run dirs. Tests diff these."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agentenv.bench.node import qemu_pids

__all__ = ["qemu_pids", "netns_names", "sandbox_dirs"]


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def sandbox_dirs(data_dir: Path) -> set[str]:
    d = data_dir / "sandboxes"
    return {p.name for p in d.iterdir()} if d.exists() else set()
