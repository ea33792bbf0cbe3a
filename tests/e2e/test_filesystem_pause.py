"""Filesystem-only pause and snapshots (E2B's ``memory: false``), on real microVMs (issue #4).

Only the disk is kept: the guest agent flushes the guest's filesystems first, and resuming
boots the template's kernel on the disk (a new ``boot_id``, no processes, every file there).
Each resume here is a cold boot, seconds under TCG."""

from __future__ import annotations

import time

import httpx

from tests.e2e.conftest import run
from tests.framework import host

WRITE = "echo fs-only > /home/user/f.txt; head -c 1048576 /dev/urandom > /home/user/blob; md5sum < /home/user/blob"


def boot_id(api: httpx.Client, sid: str) -> str:
    return run(api, sid, "cat /proc/sys/kernel/random/boot_id")["stdout"]


def files_kept(api: httpx.Client, sid: str, md5: str) -> None:
    assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "fs-only\n"
    assert run(api, sid, "md5sum < /home/user/blob")["stdout"].split()[0] == md5


def test_filesystem_only_pause_keeps_the_files_and_resume_boots_the_disk(api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600,
                                       "envVars": {"FROM_CREATE": "yes"}}).json()["sandboxID"]
    try:
        md5 = run(api, sid, WRITE)["stdout"].split()[0]  # not synced by the test: the pause must flush it
        run(api, sid, "nohup sleep 1000 >/dev/null 2>&1 &")
        assert run(api, sid, "pgrep -x sleep")["stdout"].strip(), "the process to lose is running"
        first_boot = boot_id(api, sid)

        r = api.post(f"/sandboxes/{sid}/pause", json={"memory": False})
        assert r.status_code == 204, r.text
        info = api.get(f"/sandboxes/{sid}").json()
        assert (info["state"], info["pauseMode"]) == ("paused", "filesystem")
        assert host.qemu_gone(sid)

        r = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 600})
        assert r.status_code == 201, r.text
        assert "pauseMode" not in api.get(f"/sandboxes/{sid}").json()
        rebooted = boot_id(api, sid)
        assert rebooted != first_boot, "a filesystem-only resume boots the disk"
        files_kept(api, sid, md5)
        # By name, not pid: the booted guest numbers its processes from scratch, so the old pid
        # may well be some new process's.
        assert run(api, sid, "pgrep -x sleep || echo gone")["stdout"] == "gone\n"
        # What the agent held in memory is given back to the booted agent.
        env = run(api, sid, "echo $FROM_CREATE $E2B_SANDBOX_ID; whoami; pwd")["stdout"].split()
        assert env == ["yes", sid, "user", "/home/user"]

        # A booted sandbox pauses with its memory like any other ...
        assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        assert api.get(f"/sandboxes/{sid}").json()["pauseMode"] == "full"
        assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600}).status_code == 201
        assert boot_id(api, sid) == rebooted
        files_kept(api, sid, md5)

        # ... and `memory: false` on connect drops a saved memory and boots the disk instead.
        assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
        r = api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 600, "memory": False})
        assert r.status_code == 201, r.text
        assert boot_id(api, sid) not in (first_boot, rebooted)
        files_kept(api, sid, md5)
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_filesystem_only_snapshot_starts_sandboxes_that_boot_its_disk(api: httpx.Client, sandbox: str) -> None:
    md5 = run(api, sandbox, WRITE)["stdout"].split()[0]
    r = api.post(f"/sandboxes/{sandbox}/snapshots", json={"name": "fs-only-snap", "memory": False})
    assert r.status_code == 201, r.text
    run(api, sandbox, "echo later > /home/user/f.txt")  # the source goes on; the snapshot does not see it
    try:
        r = api.post("/sandboxes", json={"templateID": "fs-only-snap", "timeout": 300})
        assert r.status_code == 201, r.text
        child = r.json()["sandboxID"]
        try:
            assert boot_id(api, child) != boot_id(api, sandbox)
            files_kept(api, child, md5)
        finally:
            api.delete(f"/sandboxes/{child}")
    finally:
        api.delete("/snapshots/fs-only-snap")


def test_auto_pause_without_memory_at_timeout(api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 6, "autoPause": True,
                                       "autoPauseMemory": False}).json()["sandboxID"]
    try:
        md5 = run(api, sid, WRITE)["stdout"].split()[0]
        # `pauseMode` appears once the pause has finished (a sandbox still pausing lists as paused)
        deadline = time.monotonic() + 30
        while "pauseMode" not in api.get(f"/sandboxes/{sid}").json() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert api.get(f"/sandboxes/{sid}").json()["pauseMode"] == "filesystem"
        assert api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300}).status_code == 201
        files_kept(api, sid, md5)
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_pause_that_needs_the_guest_agent_is_refused_when_it_does_not_answer(api: httpx.Client) -> None:
    """A filesystem-only or strict pause of a hung guest agent is refused; a plain one is
    taken and marked, and only a resume without memory may use it."""
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    try:
        # Stop the guest agent (the command's parent) with SIGSTOP once this command has answered.
        agent = run(api, sid, "echo $PPID", user="root")["stdout"].strip()
        assert "agent" in run(api, sid, f"cat /proc/{agent}/cmdline", user="root")["stdout"]
        run(api, sid, f"nohup sh -c 'sleep 1; kill -STOP {agent}' >/dev/null 2>&1 &", user="root")
        time.sleep(2)
        for body in ({"memory": False}, {"requireHealthyGuest": True}):
            r = api.post(f"/sandboxes/{sid}/pause", json=body)
            assert r.status_code == 503, r.text
            assert "keeps running" in r.json()["message"]
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert host.qemu_pids(sid) != set()
        # A plain pause is taken and marked, as E2B does: its memory would bring the hung agent
        # back, so a resume with it is a 409 whose error_code the SDKs raise as
        # GuestUnresponsiveException; without its memory (on_resume="reboot") it boots its disk.
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.get(f"/sandboxes/{sid}").json()["envdUnresponsiveAtPause"] is True
        for path in ("resume", "connect"):
            r = api.post(f"/sandboxes/{sid}/{path}", json={"timeout": 300})
            assert r.status_code == 409, r.text
            assert r.json()["error_code"] == "sandbox_snapshot_guest_agent_unresponsive", r.text
        r = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300, "memory": False})
        assert r.status_code in (200, 201), r.text
        assert run(api, sid, "echo rebooted")["stdout"] == "rebooted\n"
        assert "envdUnresponsiveAtPause" not in api.get(f"/sandboxes/{sid}").json()
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
