"""A host short of memory refuses new sandboxes with a 429 that says why, and its warm pool
waits, instead of starting QEMUs the OOM killer would then pick among running sandboxes."""

from __future__ import annotations

import time
from pathlib import Path

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
