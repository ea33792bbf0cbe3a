"""Parked VMs (orchestrator/parking.py), on real microVMs: a paused sandbox's stopped QEMU is
kept for AENV_PAUSE_LINGER_S, a resume within it continues that QEMU, and the VM is freed
when the linger ends, on kill, at stop, after a crash and under memory pressure, with nothing
of the sandbox lost in any of these."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import run
from tests.e2e.test_saved_states import COUNTER
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess

LINGER_S = 6.0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path_factory.mktemp("parked") / "data", node_cidr(33), AENV_PAUSE_LINGER_S=str(LINGER_S))
    s.start()
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def api(node: ServerProcess) -> Iterator[httpx.Client]:
    with node.client() as c:
        yield c


class Busy:
    """A sandbox with a counting process, a file on disk and 20 MiB of random data in RAM."""

    def __init__(self, api: httpx.Client) -> None:
        self.api = api
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
        assert r.status_code == 201, r.text
        self.sid = r.json()["sandboxID"]
        self.pid = run(api, self.sid, COUNTER)["stdout"].strip()
        self.md5 = run(api, self.sid, "echo on-disk > /home/user/kept.txt; head -c 20971520 /dev/urandom "
                                      "> /dev/shm/blob; md5sum < /dev/shm/blob")["stdout"].split()[0]
        self.count = 0

    def pause(self) -> None:
        self.count = int(run(self.api, self.sid, "tail -n1 /tmp/counter")["stdout"])
        r = self.api.post(f"/sandboxes/{self.sid}/pause")
        assert r.status_code == 204, r.text

    def resume(self) -> None:
        r = self.api.post(f"/sandboxes/{self.sid}/resume", json={"timeout": 600})
        assert r.status_code == 201, r.text

    def assert_intact(self) -> None:
        """Everything the sandbox had before the pause is there, and it runs on."""
        api, sid = self.api, self.sid
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert run(api, sid, f"kill -0 {self.pid} && echo alive")["stdout"] == "alive\n"
        assert run(api, sid, "cat /home/user/kept.txt")["stdout"] == "on-disk\n"
        assert run(api, sid, "md5sum < /dev/shm/blob")["stdout"].split()[0] == self.md5
        c1 = int(run(api, sid, "tail -n1 /tmp/counter")["stdout"])
        assert c1 >= self.count
        time.sleep(0.3)
        assert int(run(api, sid, "tail -n1 /tmp/counter")["stdout"]) > c1, "the counting process goes on"
        guest_now = float(run(api, sid, "date +%s.%N")["stdout"])
        assert abs(guest_now - time.time()) < 1.5, "the guest clock is set on resume"

    def kill(self) -> None:
        self.api.delete(f"/sandboxes/{self.sid}")


@pytest.fixture
def busy(api: httpx.Client) -> Iterator[Busy]:
    b = Busy(api)
    yield b
    b.kill()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_resume_within_the_linger_continues_the_same_stopped_vm(node: ServerProcess, api: httpx.Client,
                                                                  busy: Busy) -> None:
    (pid,) = host.qemu_pids(busy.sid)
    busy.pause()
    assert api.get(f"/sandboxes/{busy.sid}").json()["state"] == "paused"
    assert host.qemu_pids(busy.sid) == {pid}, "the stopped VM is kept for the linger time"
    assert node.details()["parkedVMs"] == 1
    r = api.post(f"/sandboxes/{busy.sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and "paused" in r.json()["message"]
    cpu0 = cpu_seconds(pid)
    time.sleep(2.5)  # longer than the clock check's tolerance: the guest clock stood still
    assert cpu_seconds(pid) - cpu0 < 0.1, "a parked VM uses no CPU"
    busy.resume()
    assert host.qemu_pids(busy.sid) == {pid}, "resumed on the same QEMU"
    assert node.details()["parkedVMs"] == 0
    busy.assert_intact()
    # again: a parked VM can be paused and woken any number of times
    for _ in range(3):
        busy.pause()
        busy.resume()
    assert host.qemu_pids(busy.sid) == {pid}
    busy.assert_intact()


def test_after_the_linger_the_vm_is_freed_and_a_resume_restores_the_saved_state(api: httpx.Client,
                                                                                busy: Busy) -> None:
    (pid,) = host.qemu_pids(busy.sid)
    busy.pause()
    time.sleep(LINGER_S + 0.5)
    assert host.qemu_gone(busy.sid), "the parked VM is freed when its linger time ends"
    assert api.get(f"/sandboxes/{busy.sid}").json()["state"] == "paused"
    busy.resume()
    assert host.qemu_pids(busy.sid) - {pid}, "a new QEMU, restored from the saved state"
    busy.assert_intact()


def test_a_parked_vm_that_died_is_replaced_by_a_restore(node: ServerProcess, busy: Busy) -> None:
    (pid,) = host.qemu_pids(busy.sid)
    busy.pause()
    os.kill(pid, signal.SIGKILL)
    assert host.qemu_gone(busy.sid)
    busy.resume()
    busy.assert_intact()
    assert "its parked VM could not be continued" in node.log.read_text()


def test_parked_fork_children_keep_their_memory_file_through_a_gc(api: httpx.Client, busy: Busy) -> None:
    """Fork children map their fork's memory file; parked, they still do. A gc meanwhile (any
    kill runs one) must not delete it: the woken child could not be paused or forked again."""
    r = api.post(f"/sandboxes/{busy.sid}/fork", json={"count": 2, "timeout": 600})
    assert r.status_code == 201, r.text
    kids = [item["sandbox"]["sandboxID"] for item in r.json()]
    try:
        pids = {k: host.qemu_pids(k) for k in kids}
        for k in kids:
            assert api.post(f"/sandboxes/{k}/pause").status_code == 204
        other = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        assert api.delete(f"/sandboxes/{other}").status_code == 204  # runs the gc
        time.sleep(0.5)
        for k in kids:
            assert api.post(f"/sandboxes/{k}/resume", json={"timeout": 600}).status_code == 201
            assert host.qemu_pids(k) == pids[k], "woken on its parked VM"
            r = api.post(f"/sandboxes/{k}/pause")
            assert r.status_code == 204, r.text
            assert api.post(f"/sandboxes/{k}/resume", json={"timeout": 600}).status_code == 201
            assert run(api, k, "md5sum < /dev/shm/blob")["stdout"].split()[0] == busy.md5
    finally:
        for k in kids:
            api.delete(f"/sandboxes/{k}")


def test_killing_a_parked_sandbox_frees_its_vm_and_namespace(node: ServerProcess, api: httpx.Client) -> None:
    b = Busy(api)
    ns = host.netns_of(next(iter(host.qemu_pids(b.sid))))
    assert ns in host.netns_names()
    b.pause()
    assert api.delete(f"/sandboxes/{b.sid}").status_code == 204
    assert host.qemu_gone(b.sid, timeout=5)
    assert b.sid not in host.sandbox_dirs(node.data_dir)
    deadline = time.monotonic() + 10  # the namespace goes after the answer
    while ns in host.netns_names() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ns not in host.netns_names()
    assert api.get(f"/sandboxes/{b.sid}").status_code == 404


def test_stop_and_crash_free_parked_vms_and_lose_no_sandbox(node: ServerProcess, api: httpx.Client) -> None:
    b = Busy(api)
    try:
        b.pause()
        assert host.qemu_pids(b.sid)
        node.stop(signal.SIGTERM)
        assert host.qemu_gone(b.sid, timeout=5), "a clean stop frees parked VMs (their state is saved)"
        node.start()
        b.resume()
        b.assert_intact()
        b.pause()
        (pid,) = host.qemu_pids(b.sid)
        node.stop(signal.SIGKILL)
        assert host.qemu_pids(b.sid) == {pid}, "a crashed server leaves its parked VM"
        node.start()
        assert host.qemu_gone(b.sid, timeout=5), "recovery kills the VM of a paused sandbox"
        assert api.get(f"/sandboxes/{b.sid}").json()["state"] == "paused"
        b.resume()
        b.assert_intact()
    finally:
        b.kill()


def test_parked_vms_are_freed_first_below_the_memory_reserve(tmp_path: Path) -> None:
    from agentenv.orchestrator.capacity import mem_available_mb

    avail = mem_available_mb()
    assert avail is not None and avail > 6000, "this test takes 3 GiB of the host's memory for a while"
    s = ServerProcess(tmp_path / "data", node_cidr(34), AENV_POOL_SIZE="1", AENV_MEM_RESERVE_MB=str(avail - 1500),
                      AENV_PAUSE_LINGER_S="60")
    s.start()
    try:
        with s.client() as api:
            b = Busy(api)
            b.pause()
            assert host.qemu_pids(b.sid), "parked (the default linger is a minute)"
            hog = b"\x01" * (2500 << 20)  # real memory pressure: the host goes inside its reserve
            assert host.qemu_gone(b.sid, timeout=15), "the parked VM is freed below the reserve"
            assert "below its memory reserve" in s.log.read_text()
            del hog
            deadline = time.monotonic() + 30
            while api.post(f"/sandboxes/{b.sid}/resume", json={"timeout": 600}).status_code == 429:
                assert time.monotonic() < deadline, "the resume is admitted once memory is back"
                time.sleep(1)
            b.assert_intact()
            b.kill()
    finally:
        s.kill_all()


def test_parked_vms_count_against_the_sandbox_limit(tmp_path: Path) -> None:
    """With AENV_MAX_SANDBOXES=2: a parked VM makes way for a new sandbox instead of the
    create being refused, and the paused sandbox still resumes (restored) afterwards."""
    s = ServerProcess(tmp_path / "data", node_cidr(35), AENV_POOL_SIZE="0", AENV_MAX_SANDBOXES="2",
                      AENV_PAUSE_LINGER_S="60")
    s.start()
    try:
        with s.client() as api:
            a, b = Busy(api), Busy(api)
            a.pause()
            assert host.qemu_pids(a.sid), "parked"
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
            assert r.status_code == 201, r.text
            assert host.qemu_gone(a.sid, timeout=5), "the parked VM made way"
            assert "AENV_MAX_SANDBOXES" in s.log.read_text()
            assert api.post(f"/sandboxes/{a.sid}/resume", json={"timeout": 600}).status_code == 429, \
                "two run: the limit holds for the resume"
            api.delete(f"/sandboxes/{r.json()['sandboxID']}")
            a.resume()
            a.assert_intact()
            b.assert_intact()
    finally:
        s.kill_all()


def pause_manifests(data_dir: Path, sid: str) -> list[str]:
    out = []
    for p in (data_dir / "repository" / "manifests").glob("*.json"):
        m = json.loads(p.read_text())
        if m.get("kind") == "pause" and m.get("source_sandbox") == sid:
            out.append(p.name)
    return out


def test_a_resume_in_progress_counts_once_against_the_sandbox_limit(tmp_path: Path) -> None:
    """A resume was counted as a VM being admitted and again as the active sandbox it is
    while its VM starts: with AENV_MAX_SANDBOXES=2, one resume in progress made a create 429
    (and evicted parked VMs for room that was there). The resume here is held for the restore
    timeout by the injected fault ``hang_after_resume``."""
    s = ServerProcess(tmp_path / "data", node_cidr(56), AENV_POOL_SIZE="0", AENV_MAX_SANDBOXES="2",
                      AENV_PAUSE_LINGER_S="0", AENV_FAULTS="hang_after_resume", AENV_RESTORE_TIMEOUT="8")
    s.start()
    try:
        with s.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            assert host.qemu_gone(sid, timeout=10)

            def resume() -> httpx.Response:
                with s.client() as other:
                    return other.post(f"/sandboxes/{sid}/resume", json={"timeout": 600})

            with ThreadPoolExecutor(1) as ex:
                pending = ex.submit(resume)
                deadline = time.monotonic() + 20
                while not host.qemu_pids(sid) and time.monotonic() < deadline:  # its new VM is starting
                    time.sleep(0.05)
                assert not pending.done(), pending.result().text
                r = api.post("/sandboxes", json={"templateID": "base"})  # admitted at once, while it resumes
                assert r.status_code == 201, r.text  # two VMs: the resumed one and this one
                api.delete(f"/sandboxes/{r.json()['sandboxID']}")
                pending.result()
    finally:
        s.kill_all()


def test_a_wake_whose_guest_or_qemu_fails_after_cont_is_answered_and_leaves_nothing(tmp_path: Path) -> None:
    """Once ``cont`` ran there is no going back to the saved state (the guest ran; its disk
    moved on). Injected fault ``hang_after_wake``: the VM is stopped again right after ``cont``,
    so the guest never answers the clock update. The resume then answers 502 within the
    restore timeout and the sandbox is ``running`` (it can be killed, or retried); if its QEMU
    dies meanwhile, the resume answers 500 and the sandbox is ``error``. A resume after the
    linger, into a new QEMU on the sandbox's own disk, whose guest does not answer in time
    (fault ``hang_after_resume``: it goes on 2 s later) also stays ``running`` with a 502, and
    gets its clock once it answers. Each time a kill leaves no QEMU, run dir or namespace."""
    s = ServerProcess(tmp_path / "data", node_cidr(37), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_PAUSE_LINGER_S="3", AENV_FAULTS="hang_after_wake,hang_after_resume",
                      AENV_RESTORE_TIMEOUT="3")
    s.start()

    def gone(sid: str, ns: str) -> None:
        assert host.qemu_gone(sid, timeout=5)
        assert sid not in host.sandbox_dirs(s.data_dir)
        deadline = time.monotonic() + 10  # the namespace goes after the answer
        while ns in host.netns_names() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ns not in host.netns_names()

    try:
        with s.client() as api:
            # The guest does not answer after cont.
            b = Busy(api)
            (pid,) = host.qemu_pids(b.sid)
            ns = host.netns_of(pid)
            b.pause()
            t0 = time.monotonic()
            r = api.post(f"/sandboxes/{b.sid}/resume", json={"timeout": 600})
            assert r.status_code == 502 and "did not answer" in r.json()["message"], r.text
            assert time.monotonic() - t0 < 15, "bounded by the restore timeout"
            assert api.get(f"/sandboxes/{b.sid}").json()["state"] == "running"
            assert host.qemu_pids(b.sid) == {pid}, "the VM that ran is kept, not swapped for the saved state"
            assert api.post(f"/sandboxes/{b.sid}/resume").status_code == 409, "it is not paused any more"
            assert api.delete(f"/sandboxes/{b.sid}").status_code == 204
            gone(b.sid, ns)

            # Its QEMU dies while the resume waits for the guest.
            b = Busy(api)
            (pid,) = host.qemu_pids(b.sid)
            ns = host.netns_of(pid)
            b.pause()
            assert len(pause_manifests(s.data_dir, b.sid)) == 1

            def resume() -> httpx.Response:
                with s.client() as other:
                    return other.post(f"/sandboxes/{b.sid}/resume", json={"timeout": 600})

            with ThreadPoolExecutor(1) as ex:
                pending = ex.submit(resume)
                time.sleep(1.0)  # within the 3 s the resume waits for the stopped guest
                assert not pending.done(), pending.result().text
                os.kill(pid, signal.SIGKILL)
                r = pending.result()
            assert r.status_code == 500 and "QEMU exited" in r.json()["message"], r.text
            info = api.get(f"/sandboxes/{b.sid}").json()
            assert info["state"] == "error" and "QEMU exited" in info["error"], info
            assert pause_manifests(s.data_dir, b.sid) == [], "the pause's manifest is dropped once its VM ran"
            assert api.delete(f"/sandboxes/{b.sid}").status_code == 204
            gone(b.sid, ns)
            assert api.get(f"/sandboxes/{b.sid}").status_code == 404

            # The same after the linger, on a new QEMU restored on the sandbox's own disk
            # (injected fault hang_after_resume): the guest ran, so it stays running.
            b = Busy(api)
            b.pause()
            assert host.qemu_gone(b.sid, timeout=10), "freed after its linger"
            r = api.post(f"/sandboxes/{b.sid}/resume", json={"timeout": 600})
            assert r.status_code == 502 and "runs again" in r.json()["message"], r.text
            assert api.get(f"/sandboxes/{b.sid}").json()["state"] == "running"
            # The fault lets the guest go on 2 s after the restore timeout: it was only slow, and
            # the server gives it the clock once it answers (it stood still while paused).
            deadline = time.monotonic() + 30
            while f"sandbox {b.sid}: its guest answered" not in s.log.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            b.assert_intact()
            (pid,) = host.qemu_pids(b.sid)
            ns = host.netns_of(pid)
            assert api.delete(f"/sandboxes/{b.sid}").status_code == 204
            gone(b.sid, ns)

            # ... and if that new QEMU dies while the resume waits for the guest: error, as a wake.
            b = Busy(api)
            b.pause()
            assert host.qemu_gone(b.sid, timeout=10)
            with ThreadPoolExecutor(1) as ex:
                pending = ex.submit(resume)
                deadline = time.monotonic() + 10  # restored (logged), then waiting for the stopped guest
                while f"restore {b.sid}:" not in s.log.read_text() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not pending.done(), pending.result().text
                (pid,) = host.qemu_pids(b.sid)
                ns = host.netns_of(pid)
                os.kill(pid, signal.SIGKILL)
                r = pending.result()
            assert r.status_code == 500 and "QEMU exited" in r.json()["message"], r.text
            deadline = time.monotonic() + 10
            while api.get(f"/sandboxes/{b.sid}").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            info = api.get(f"/sandboxes/{b.sid}").json()
            assert info["state"] == "error" and "QEMU exited" in info["error"], info
            assert pause_manifests(s.data_dir, b.sid) == [], "the pause's manifest is dropped once its VM ran"
            assert api.delete(f"/sandboxes/{b.sid}").status_code == 204
            gone(b.sid, ns)
    finally:
        s.kill_all()


def test_a_resume_whose_running_record_cannot_be_written_still_watches_its_vm(tmp_path: Path) -> None:
    """The store fails once the restored guest ran (while the resume waits for it, fault
    ``hang_after_resume``). The VM runs, so the sandbox is running whatever the store says:
    the resume answers as it would without the fault, the pause's manifest goes, and the
    sandbox's QEMU is watched: killed, the sandbox becomes ``error``. Before, the failed write
    skipped all three, and a dead QEMU went unnoticed."""
    s = ServerProcess(tmp_path / "data", node_cidr(47), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_PAUSE_LINGER_S="0", AENV_FAULTS="hang_after_resume", AENV_RESTORE_TIMEOUT="3")
    s.start()
    try:
        with s.client() as api:
            b = Busy(api)
            b.pause()
            assert host.qemu_gone(b.sid, timeout=10)
            with ThreadPoolExecutor(1) as ex:
                pending = ex.submit(lambda: s.client().post(f"/sandboxes/{b.sid}/resume", json={"timeout": 600}))
                deadline = time.monotonic() + 10  # restored (logged), then waiting for the stopped guest
                while f"restore {b.sid}:" not in s.log.read_text() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not pending.done(), pending.result().text
                with host.store_unwritable(s.data_dir):
                    r = pending.result()
            assert r.status_code == 502 and "runs again" in r.json()["message"], r.text
            assert "recording it as running failed" in s.log.read_text()
            assert api.get(f"/sandboxes/{b.sid}").json()["state"] == "running"
            assert pause_manifests(s.data_dir, b.sid) == []
            (pid,) = host.qemu_pids(b.sid)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while api.get(f"/sandboxes/{b.sid}").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            info = api.get(f"/sandboxes/{b.sid}").json()
            assert info["state"] == "error" and "QEMU exited" in info["error"], info
            assert api.delete(f"/sandboxes/{b.sid}").status_code == 204
            assert host.qemu_gone(b.sid) and b.sid not in host.sandbox_dirs(s.data_dir)
    finally:
        s.kill_all()


def test_concurrent_pauses_resumes_and_kills_race_the_linger_and_lose_nothing(tmp_path: Path) -> None:
    """Four clients pause, resume and kill their sandboxes at once, with a linger of one second:
    resumes land before, at and after the expiry, kills land on parked and freed VMs. Every
    resume finds the sandbox's file and RAM data intact, and nothing is left afterwards."""
    s = ServerProcess(tmp_path / "data", node_cidr(36), AENV_POOL_SIZE="2", AENV_SLOT_POOL_SIZE="2",
                      AENV_PAUSE_LINGER_S="1")
    s.start()
    rng = random.Random(7)

    async def client(c: httpx.AsyncClient, w: int) -> None:
        for r in range(5):
            r0 = await c.post("/sandboxes", json={"templateID": "base", "timeout": 600})
            assert r0.status_code == 201, r0.text
            sid = r0.json()["sandboxID"]
            tag = f"{w}-{r}"
            try:
                out = await c.post(f"/sandboxes/{sid}/exec", json={"cmd": f"echo {tag} > /home/user/tag; "
                                   "head -c 4000000 /dev/urandom > /dev/shm/b; md5sum < /dev/shm/b > /home/user/m"})
                assert out.status_code == 200, out.text
                for _ in range(rng.randint(1, 3)):
                    p = await c.post(f"/sandboxes/{sid}/pause")
                    assert p.status_code == 204, p.text
                    await asyncio.sleep(rng.choice([0, 0.3, 0.9, 1.0, 1.1, 1.6]))
                    if rng.random() < 0.2:
                        break  # killed while paused: parked, being freed, or freed
                    q = await c.post(f"/sandboxes/{sid}/resume", json={"timeout": 600})
                    assert q.status_code == 201, q.text
                    out = await c.post(f"/sandboxes/{sid}/exec", json={
                        "cmd": "cat /home/user/tag; md5sum < /dev/shm/b | diff - /home/user/m && echo same"})
                    assert out.json()["stdout"] == f"{tag}\nsame\n", out.text
            finally:
                d = await c.delete(f"/sandboxes/{sid}")
                assert d.status_code == 204, d.text

    async def main() -> None:
        async with httpx.AsyncClient(base_url=s.url, headers={"X-API-Key": s.api_key}, timeout=120) as c:
            await asyncio.gather(*(client(c, w) for w in range(4)))

    try:
        asyncio.run(main())
        with s.client() as api:
            assert api.get("/sandboxes", params={"state": "running,paused,error"}).json() == []
        deadline = time.monotonic() + 60  # the pool refills after the last creates
        while (d := s.details())["poolReady"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d["parkedVMs"] == 0 and d["sandboxes"] == {} and d["poolReady"] == 2, d
        assert len(host.qemu_pids(str(s.data_dir))) == d["poolReady"], "only the warm pool's shells run"
        assert len(host.sandbox_dirs(s.data_dir)) == d["poolReady"], "no run dir but the shells'"
        assert "Traceback" not in s.log.read_text()
    finally:
        s.kill_all()
