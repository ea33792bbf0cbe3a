"""One server per data directory and per snapshot repository (storage/ownership.py): a second
server on either would delete the first one's snapshots in its recovery and gc, so it is
refused at start, naming the holder; a server that died (SIGKILL) locks nobody out."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from agentenv.config import Settings
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess


def test_a_second_server_on_a_data_dir_or_repository_in_use_is_refused(tmp_path: Path) -> None:
    first = ServerProcess(tmp_path / "a", node_cidr(51), AENV_POOL_SIZE="0", AENV_SNAPSHOT_POOL_SIZE="0")
    first.start()
    others: list[ServerProcess] = []
    try:
        shared_repo = ServerProcess(tmp_path / "b", node_cidr(52), AENV_POOL_SIZE="0",
                                    AENV_REPOSITORY_DIR=str(tmp_path / "a" / "repository"))
        same_data = ServerProcess(tmp_path / "a", node_cidr(53), AENV_POOL_SIZE="0")
        others += [shared_repo, same_data]
        for other, what in ((shared_repo, "the snapshot repository"), (same_data, "the data directory")):
            with pytest.raises(RuntimeError) as err:
                other.start()
            assert f"{what} " in str(err.value) and f"is in use by the AgentENV server of pid {first.proc.pid}" \
                in str(err.value), str(err.value)[-600:]
        assert httpx.get(first.url + "/health").status_code == 204  # the first one untouched
        # and no other local user reads what they hold: tokens, env vars, guest memory
        settings_dirs = [tmp_path / "a", tmp_path / "a" / "repository"]
        assert [oct(d.stat().st_mode & 0o777) for d in settings_dirs] == ["0o700", "0o700"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        shared_repo.start()  # the dead server's locks went with it
        assert httpx.get(shared_repo.url + "/health").status_code == 204
    finally:
        for s in (*others, first):
            s.kill_all()


def test_no_other_local_user_reads_a_nodes_data() -> None:
    """The store holds every sandbox's envd access token and env vars, the repository their
    snapshots (disk layers are world-readable files), the memory dir guest RAM: a local user
    who is not the server's must read none of it (here ``nobody``, on a data dir in a place
    everyone may enter)."""
    top = Path(tempfile.mkdtemp(prefix="aenv-private-", dir="/var/tmp"))
    os.chmod(top, 0o755)
    node = ServerProcess(top / "data", node_cidr(55), AENV_POOL_SIZE="0", AENV_SNAPSHOT_POOL_SIZE="0")
    node.start()
    try:
        with node.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            api.post(f"/sandboxes/{sid}/snapshots", json={}).raise_for_status()
        layers = list((top / "data" / "repository" / "layers").iterdir())
        assert layers and any(p.stat().st_mode & 0o004 for p in layers)  # what the doors must guard
        mem_file = next(p for p in Settings(data_dir=top / "data").mem_dir.iterdir() if p.is_file())
        for path in (top / "data" / "state.sqlite", layers[0], mem_file):
            peek = subprocess.run(["runuser", "-u", "nobody", "--", "head", "-c", "1", str(path)],
                                  capture_output=True, text=True)
            assert peek.returncode != 0 and "Permission denied" in peek.stderr, (path, peek)
    finally:
        node.kill_all()
        shutil.rmtree(top, ignore_errors=True)
        node.log.unlink(missing_ok=True)
