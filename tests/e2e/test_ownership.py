"""One server per data directory and per snapshot repository (storage/ownership.py): a second
server on either would delete the first one's snapshots in its recovery and gc, so it is
refused at start, naming the holder; a server that died (SIGKILL) locks nobody out."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

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
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        shared_repo.start()  # the dead server's locks went with it
        assert httpx.get(shared_repo.url + "/health").status_code == 204
    finally:
        for s in (*others, first):
            s.kill_all()
