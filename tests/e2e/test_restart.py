"""A server restart loses nothing: sandboxes keep running and are re-adopted."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess


def test_restart_readopts_running_sandboxes(tmp_path: Path) -> None:
    s = ServerProcess(tmp_path / "data", node_cidr(18))
    s.start()
    try:
        with s.client() as api:
            keep = api.post("/sandboxes", json={"templateID": "base", "metadata": {"k": "v"}}).json()["sandboxID"]
            doomed = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            garbled = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            run(api, keep, "echo before > /home/user/state.txt; (sleep 1000 &) ; true")
            (doomed_pid,) = host.qemu_pids(doomed)
        # uvicorn re-raises the signal after its graceful shutdown, hence -SIGTERM.
        assert s.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
        assert "orchestrator stopped cleanly; 3 running and 0 paused sandboxes left" in s.log.read_text()
        assert host.qemu_pids(keep), "SIGTERM must not kill sandboxes"
        os.kill(doomed_pid, signal.SIGKILL)  # this one dies while the server is down
        # This one's record of its machine is damaged (say, by a version that wrote other fields):
        # the server must still start, fail that sandbox with the reason and stop its QEMU.
        (s.data_dir / "sandboxes" / garbled / "machine.json").write_text('{"pid_file": "x"}')
        s.start()
        with s.client() as api:
            assert api.get(f"/sandboxes/{keep}").json()["state"] == "running"
            assert api.get(f"/sandboxes/{keep}").json()["metadata"] == {"k": "v"}
            assert run(api, keep, "cat /home/user/state.txt")["stdout"] == "before\n"
            assert run(api, keep, "pgrep -c sleep")["stdout"].strip() == "1"
            r = api.get(f"/sandboxes/{doomed}")
            assert r.status_code == 410 and r.json()["state"] == "error" and "gone" in r.json()["error"]
            r = api.get(f"/sandboxes/{garbled}")
            assert r.status_code == 410 and "machine record is unreadable" in r.json()["error"]
            assert host.qemu_pids(garbled) == set(), "a sandbox that failed re-adoption keeps no QEMU"
            assert api.delete(f"/sandboxes/{garbled}").status_code == 204
        # SIGKILL of the server: the same guarantees.
        s.stop(signal.SIGKILL)
        s.start()
        with s.client() as api:
            assert run(api, keep, "cat /home/user/state.txt")["stdout"] == "before\n"
            assert api.delete(f"/sandboxes/{keep}").status_code == 204
            assert api.delete(f"/sandboxes/{doomed}").status_code == 204
        assert host.qemu_pids(keep) == set()
    finally:
        s.kill_all()


def test_stop_while_the_pool_fills_leaves_no_process(tmp_path: Path) -> None:
    """SIGTERM lands while warm-pool sandboxes are being restored: none may survive it."""
    import time


    s = ServerProcess(tmp_path / "data", node_cidr(19), AENV_POOL_SIZE="4")
    s.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            d = s.details()
            if d["poolSize"] and d["poolReady"] >= 1:
                break
            time.sleep(0.05)
        assert d["poolReady"] < d["poolSize"], "the pool filled before the stop; the test saw nothing"
        s.stop(signal.SIGTERM)
        assert host.qemu_pids(str(s.data_dir) + "/") == set()
        assert host.sandbox_dirs(s.data_dir) == set()
    finally:
        s.kill_all()


def test_a_sandbox_whose_qemu_does_not_answer_fails_readoption_without_holding_up_the_start(tmp_path: Path) -> None:
    """A QEMU stopped (SIGSTOP) while the server was down takes the QMP connection but never
    greets: before, the server's start waited on it for good."""
    import time

    s = ServerProcess(tmp_path / "data", node_cidr(45))
    s.start()
    try:
        with s.client() as api:
            stuck = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            fine = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            (pid,) = host.qemu_pids(stuck)
        s.stop(signal.SIGKILL)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        s.start(timeout=90)
        assert time.monotonic() - t0 < 60
        with s.client() as api:
            r = api.get(f"/sandboxes/{stuck}")
            assert r.status_code == 410 and "QMP" in r.json()["error"], r.text
            assert host.qemu_gone(stuck), "the QEMU that did not answer was left running"
            assert run(api, fine, "echo ok")["stdout"] == "ok\n"
    finally:
        s.kill_all()
