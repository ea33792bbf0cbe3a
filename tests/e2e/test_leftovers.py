"""A node whose data dir disappeared (killed hard, then its folder deleted) leaves memory files
on tmpfs, a socket folder, an nft table and namespaces that nothing of its own will ever
remove. The next node to start on the host removes them, unless a QEMU still uses them."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from agentenv.config import Settings
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess


def _nft_tables() -> set[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def _objects(data_dir: Path) -> dict[str, bool]:
    s = Settings(data_dir=data_dir)
    return {"memory files": any(s.mem_dir.glob("*.mem")), "socket folder": s.sock_dir.exists(),
            "nft table": f"aenv_{s.instance_tag[:4]}" in _nft_tables(),
            "namespaces": bool(host.node_netns(data_dir))}


def test_the_next_node_removes_what_a_vanished_node_left(tmp_path: Path) -> None:
    gone = ServerProcess(tmp_path / "gone" / "data", node_cidr(30), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="2")
    other = ServerProcess(tmp_path / "other" / "data", node_cidr(31), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0")
    try:
        gone.start()
        with gone.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
        gone.stop(signal.SIGKILL)
        shutil.rmtree(gone.data_dir.parent)
        assert all(_objects(gone.data_dir).values()), _objects(gone.data_dir)

        # its sandbox's QEMU still runs: nothing of that node may go
        other.start()
        assert all(_objects(gone.data_dir).values()), _objects(gone.data_dir)
        assert host.qemu_pids(sid)
        other.stop()

        for pid in host.qemu_pids(sid):
            subprocess.run(["kill", "-9", str(pid)], check=True)
        assert host.qemu_gone(sid)
        other.start()
        assert not any(_objects(gone.data_dir).values()), _objects(gone.data_dir)
        assert "whose data dir" in other.log.read_text() and str(gone.data_dir) in other.log.read_text()
        # the node that swept keeps its own
        own = _objects(other.data_dir)
        assert own["socket folder"] and own["nft table"], own
    finally:
        gone.kill_all()
        other.kill_all()
