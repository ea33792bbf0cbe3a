"""The guest CPU model under TCG is a setting (AENV_TCG_CPU), and changing it loses nothing.

A saved machine can only be restored with the CPU it was saved with: a process that chose AVX
code at its start faults on a CPU without AVX. So pauses and snapshots taken under one model
must come back under that model after a restart with another, while new sandboxes get the new
one.
"""

from __future__ import annotations

import time
from pathlib import Path

from agentenv.config import DEFAULT_TCG_CPU
from tests.e2e.conftest import run
from tests.e2e.test_saved_states import COUNTER, counter
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess


def _cpu_arg(sid: str) -> str:
    (pid,) = host.qemu_pids(sid)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("-cpu") + 1]


def _flags(api, sid: str) -> set[str]:  # type: ignore[no-untyped-def]
    return set(run(api, sid, "grep -m1 ^flags /proc/cpuinfo")["stdout"].split(":")[1].split())


def test_saved_state_resumes_with_the_cpu_it_was_saved_with(tmp_path: Path) -> None:
    s = ServerProcess(tmp_path / "data", node_cidr(23), AENV_POOL_SIZE="0")
    s.start()
    try:
        with s.client() as api:
            details = api.get("/health/details").json()
            tcg = details["accel"] == "tcg"
            sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
            if tcg:  # under KVM the guest always gets the host's CPU
                assert details["cpu"] == DEFAULT_TCG_CPU == _cpu_arg(sid)
                flags = _flags(api, sid)
                assert "avx2" in flags and "erms" not in flags, flags
            run(api, sid, COUNTER)
            run(api, sid, "echo kept > /home/user/f.txt")
            assert api.post(f"/sandboxes/{sid}/snapshots", json={"name": "first-cpu"}).status_code == 201
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        s.stop()
        # A model without AVX from now on: the guest's processes chose AVX code at their start,
        # so restoring them on this CPU would fault.
        s.env["AENV_TCG_CPU"] = "qemu64"
        s.start()
        with s.client() as api:
            details = api.get("/health/details").json()
            assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600}).status_code == 201
            before = counter(api, sid)
            time.sleep(1)
            assert counter(api, sid) > before, "the counter stopped"
            assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "kept\n"
            r = api.post("/sandboxes", json={"templateID": "first-cpu", "timeout": 600})
            assert r.status_code == 201, r.text
            child = r.json()["sandboxID"]
            assert run(api, child, "cat /home/user/f.txt")["stdout"] == "kept\n"
            fresh = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
            if tcg:
                assert details["cpu"] == "qemu64" == _cpu_arg(fresh) and "avx2" not in _flags(api, fresh)
                assert _cpu_arg(sid) == DEFAULT_TCG_CPU == _cpu_arg(child)
            for x in (sid, child, fresh):
                assert api.delete(f"/sandboxes/{x}").status_code == 204
            assert api.delete("/snapshots/first-cpu").status_code == 204
    finally:
        s.kill_all()
