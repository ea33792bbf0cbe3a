"""Rollouts back to back leak nothing: after many create → command → kill cycles the server holds
as many descriptors as before and the host as many namespaces, QEMU processes and sandbox
folders. A leak of one object per sandbox would pass every single-cycle test and still sink a
training run after a few thousand rollouts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from agentenv.bench.stats import wait_pool
from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.server import ServerProcess

CYCLES = 60


def _server_pid(server: ServerProcess) -> int:
    assert server.proc is not None
    return server.proc.pid  # setpriv execs the server: the same pid


def _counts(server: ServerProcess) -> dict[str, int]:
    return {
        "descriptors": len(os.listdir(f"/proc/{_server_pid(server)}/fd")),
        "namespaces": len(host.node_netns(server.data_dir)),
        "qemu": len(host.qemu_pids(str(server.data_dir) + "/")),
        "sandbox folders": len(host.sandbox_dirs(server.data_dir)),
    }


def _held(server: ServerProcess) -> dict[str, int]:
    """What the node holds once its pool is full and two looks half a second apart agree
    (namespaces go just after a kill's answer, pool shells come back in the background)."""
    wait_pool(server, 120)
    deadline = time.monotonic() + 15
    last = _counts(server)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _counts(server)
        if now == last:
            break
        last = now
    return last


def _cycle(api: httpx.Client, i: int) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()["sandboxID"]
    assert run(api, sid, f"echo {i} > /tmp/n; cat /tmp/n")["stdout"] == f"{i}\n"
    assert api.delete(f"/sandboxes/{sid}").status_code == 204


def test_rollouts_back_to_back_leak_nothing(api: httpx.Client, server: ServerProcess) -> None:
    _cycle(api, -1)  # the template is hot and its pool kept full from here on
    before = _held(server)
    for i in range(CYCLES):
        _cycle(api, i)
    after = _held(server)
    assert after["namespaces"] == before["namespaces"], (before, after)
    assert after["qemu"] == before["qemu"], (before, after)
    assert after["sandbox folders"] == before["sandbox folders"], (before, after)
    # a kept-alive API connection or two may come and go; one per sandbox would be CYCLES
    assert after["descriptors"] <= before["descriptors"] + 4, (before, after)
    assert Path(f"/proc/{_server_pid(server)}").exists()
