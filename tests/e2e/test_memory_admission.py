"""A host short of memory refuses new sandboxes with a 429 that says why, and its warm pool
waits, instead of starting QEMUs the OOM killer would then pick among running sandboxes."""

from __future__ import annotations

import time
from pathlib import Path

from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess


def test_creates_and_the_pool_stop_above_the_memory_reserve(tmp_path: Path) -> None:
    s = ServerProcess(tmp_path / "data", node_cidr(29), AENV_POOL_SIZE="2")
    s.start()
    try:
        with s.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        s.stop()
        # more memory kept free than this host has: nothing new fits
        s.env["AENV_MEM_RESERVE_MB"] = str(1 << 40)
        s.start()
        with s.client() as api:
            r = api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 429, r.text
            assert "AENV_MEM_RESERVE_MB" in r.json()["message"] and r.headers["retry-after"] == "5"
            r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600})
            assert r.status_code == 429, r.text
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"  # kept, resumable later
            time.sleep(3)
            assert api.get("/health/details").json()["poolReady"] == 0
            assert host.qemu_pids(str(tmp_path / "data")) == set()
        s.stop()
        del s.env["AENV_MEM_RESERVE_MB"]
        s.start()
        with s.client() as api:
            assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600}).status_code == 201
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        s.kill_all()


def _wait_pool(s: ServerProcess, ready: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        d = s.details()
        if d["poolReady"] == ready or time.monotonic() > deadline:
            return d
        time.sleep(0.2)


def test_the_warm_pool_gives_its_shells_back_below_the_reserve_and_refills_after(tmp_path: Path) -> None:
    from agentenv.orchestrator.capacity import mem_available_mb

    avail = mem_available_mb()
    assert avail is not None and avail > 6000, "this test takes 3 GiB of the host's memory for a while"
    s = ServerProcess(tmp_path / "data", node_cidr(32), AENV_POOL_SIZE="3",
                      AENV_MEM_RESERVE_MB=str(avail - 1500))
    s.start()
    try:
        with s.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
            assert _wait_pool(s, 3, 120)["poolReady"] == 3
            # real memory pressure: 2.5 GiB written by this process takes the host inside its reserve
            hog = b"\x01" * (2500 << 20)
            d = _wait_pool(s, 0, 60)
            assert d["poolReady"] == 0, d
            deadline = time.monotonic() + 10  # the log line follows the last shell's teardown
            while "below its memory reserve" not in s.log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "below its memory reserve" in s.log.read_text()
            assert host.qemu_pids(str(tmp_path / "data")) == host.qemu_pids(sid), "only the sandbox is left"
            assert api.post("/sandboxes", json={"templateID": "base"}).status_code == 429
            assert run(api, sid, "echo alive")["stdout"] == "alive\n", "the running sandbox is untouched"
            del hog
            assert _wait_pool(s, 3, 120)["poolReady"] == 3
            assert api.post("/sandboxes", json={"templateID": "base"}).status_code == 201
    finally:
        s.kill_all()
