"""Faults: QEMU killed under a sandbox, a full disk, a hung guest agent, a full node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess, all_sandboxes


def _ns_identity(name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/run/netns/{name}")
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def test_qemu_killed_marks_error_and_frees_resources(api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    (pid,) = host.qemu_pids(sid)
    ns = json.loads((server.data_dir / "sandboxes" / sid / "machine.json").read_text())["netns"]
    # The namespace itself, not its reusable name: the slot pool may make a new one under that
    # name, and the kernel may give it the freed namespace's inode number, but not its birth.
    ns_id = _ns_identity(ns)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    r = api.get(f"/sandboxes/{sid}")
    while time.monotonic() < deadline and r.status_code == 200:
        time.sleep(0.1)
        r = api.get(f"/sandboxes/{sid}")
    # 410 Gone, the reason in the message (what E2B SDKs raise) and in the native fields.
    info = r.json()
    assert r.status_code == 410 and info["state"] == "error" and "QEMU exited" in info["error"], r.text
    assert "QEMU exited" in info["message"] and info["code"] == 410
    assert [s["state"] for s in all_sandboxes(api) if s["sandboxID"] == sid] == ["error"]
    assert sid not in [s["sandboxID"] for s in api.get("/sandboxes").json()]  # E2B clients' list
    # Slots are named by index and the slot pool may already have made a new one under the
    # same name: what must be gone is this sandbox's namespace.
    def ns_freed() -> bool:
        return _ns_identity(ns) != ns_id
    deadline = time.monotonic() + 15
    while not ns_freed() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ns_freed(), "namespace not freed"
    # Gone for every operation (404, as E2B answers for a sandbox that died), with the reason.
    for path, body in ((f"/sandboxes/{sid}/exec", {"cmd": "true"}), (f"/sandboxes/{sid}/pause", None),
                       (f"/sandboxes/{sid}/connect", {"timeout": 60}), (f"/sandboxes/{sid}/timeout", {"timeout": 60})):
        r = api.post(path, json=body)
        assert r.status_code == 404 and "QEMU exited" in r.json()["message"], (path, r.text)
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.get(f"/sandboxes/{sid}").status_code == 404


def test_a_failed_sandbox_nobody_deletes_is_kept_a_while_then_removed(tmp_path: Path) -> None:
    """A trainer that gets a 410 for a crashed sandbox often moves on without deleting it. The
    failed sandbox stays listed with its reason for AENV_ERROR_KEEP_S (here 3 s), past its
    timeout (2 s), and is then removed with its run dir, as a timeout removes a running one."""
    s = ServerProcess(tmp_path / "data", node_cidr(48), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_ERROR_KEEP_S="3")
    s.start()
    try:
        with s.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 2}).json()["sandboxID"]
            (pid,) = host.qemu_pids(sid)
            os.kill(pid, signal.SIGKILL)
            failed_at = time.monotonic()
            time.sleep(2)  # past its timeout, within the keep
            (rec,) = [x for x in all_sandboxes(api) if x["sandboxID"] == sid]
            assert rec["state"] == "error" and "QEMU exited" in rec["error"], rec
            assert api.get(f"/sandboxes/{sid}").status_code == 410
            while api.get(f"/sandboxes/{sid}").status_code == 410 and time.monotonic() < failed_at + 10:
                time.sleep(0.2)
            assert api.get(f"/sandboxes/{sid}").status_code == 404
            assert time.monotonic() - failed_at >= 2.5
            assert all_sandboxes(api) == []
            deadline = time.monotonic() + 10  # (its run dir goes after the removal has answered)
            while host.sandbox_dirs(s.data_dir) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert host.sandbox_dirs(s.data_dir) == set()
    finally:
        s.kill_all()


@pytest.fixture(scope="module")
def small_disk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A node whose data dir is a 256 MiB tmpfs (the template snapshot, with its ~100 MiB memory
    copy, fits; little else does), with no warm pool, no ready network slots (so every
    namespace it has belongs to a sandbox) and room for 2 sandboxes."""
    mnt = tmp_path_factory.mktemp("smalldisk")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], check=True)
    s = ServerProcess(mnt / "data", node_cidr(16), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_MAX_SANDBOXES="2")
    try:
        s.start()
        yield s
        s.kill_all()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_node_answers_429(small_disk_server: ServerProcess) -> None:
    with small_disk_server.client() as api:
        ids = []
        for _ in range(2):
            r = api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["sandboxID"])
        r = api.post("/sandboxes", json={"templateID": "base"})
        assert r.status_code == 429 and "maximum of 2" in r.json()["message"]
        assert r.headers.get("retry-after")
        for sid in ids:
            api.delete(f"/sandboxes/{sid}")


def test_disk_full_while_creating_leaves_nothing(small_disk_server: ServerProcess) -> None:
    data = small_disk_server.data_dir
    with small_disk_server.client() as api:
        first = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        before = (host.sandbox_dirs(data), host.qemu_pids(str(data)), host.node_netns(data))
        filler = data / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=400"], capture_output=True)
        try:
            r = api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 507, r.text
            assert "space" in r.json()["message"]
            after = (host.sandbox_dirs(data), host.qemu_pids(str(data)), host.node_netns(data))
            assert after == before
            assert [s["sandboxID"] for s in all_sandboxes(api)] == [first]
        finally:
            filler.unlink()
        r = api.post("/sandboxes", json={"templateID": "base"})
        assert r.status_code == 201, r.text
        assert run(api, r.json()["sandboxID"], "echo ok")["stdout"] == "ok\n"
        for s in all_sandboxes(api):
            api.delete(f"/sandboxes/{s['sandboxID']}")


def test_hung_guest_agent_fails_create_in_bounded_time(tmp_path: Path) -> None:
    s = ServerProcess(tmp_path / "data", node_cidr(17), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_FAULTS="hang_after_restore", AENV_RESTORE_TIMEOUT="3")
    s.start()
    try:
        with s.client() as api:
            # The first create also builds the template snapshot (a cold boot); time the second.
            api.post("/sandboxes", json={"templateID": "base"})
            before = (host.sandbox_dirs(s.data_dir), host.qemu_pids(str(s.data_dir)), host.node_netns(s.data_dir))

            def create() -> tuple[httpx.Response, float]:
                t0 = time.monotonic()
                with s.client() as other:
                    return other.post("/sandboxes", json={"templateID": "base"}), time.monotonic() - t0

            with ThreadPoolExecutor(2) as threads:
                pending = threads.submit(create)
                creating: list[dict] = []
                while not creating and not pending.done():
                    creating = api.get("/sandboxes", params={"state": "creating"}).json()
                    time.sleep(0.05)
                assert creating, "the hung create was never listed as creating"
                # E2B clients parse only running and paused: a GET waits for the create to end
                # (here it fails, so the sandbox is gone), and a DELETE does not race it.
                sid = creating[0]["sandboxID"]
                with s.client() as other:
                    get = threads.submit(other.get, f"/sandboxes/{sid}")
                    assert api.delete(f"/sandboxes/{sid}").status_code == 404
                    assert get.result().status_code == 404
                r, elapsed = pending.result()
            assert r.status_code == 502, r.text
            assert "did not answer" in r.json()["message"]
            # E2B SDKs resend 502s unless told not to: this create must not start more VMs.
            assert r.headers["should-retry"] == "false"
            assert elapsed < 20, elapsed
            assert all_sandboxes(api) == []
            after = (host.sandbox_dirs(s.data_dir), host.qemu_pids(str(s.data_dir)), host.node_netns(s.data_dir))
            assert after == before
    finally:
        s.kill_all()


def test_a_failed_create_whose_qemu_will_not_die_is_kept_as_error_until_a_kill_frees_it(tmp_path: Path) -> None:
    """A create fails (its guest never answers) and its QEMU does not exit on SIGKILL (frozen in
    the kernel). The sandbox must not vanish with its QEMU and namespace, nor stay "creating":
    it is listed as error, saying so, across a restart, and a kill once the QEMU can die frees
    everything it held."""
    s = ServerProcess(tmp_path / "data", node_cidr(46), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_FAULTS="hang_after_restore", AENV_RESTORE_TIMEOUT="4")
    s.start()
    try:
        with s.client() as api:
            api.post("/sandboxes", json={"templateID": "base"})  # builds the template snapshot
            before = (host.sandbox_dirs(s.data_dir), host.qemu_pids(str(s.data_dir)), host.node_netns(s.data_dir))
            with ThreadPoolExecutor(1) as threads:
                pending = threads.submit(lambda: s.client().post("/sandboxes", json={"templateID": "base"}))
                creating: list[dict] = []
                while not creating and not pending.done():
                    creating = api.get("/sandboxes", params={"state": "creating"}).json()
                    time.sleep(0.05)
                sid = creating[0]["sandboxID"]
                (pid,) = host.qemu_pids(sid)
                time.sleep(1)  # its guest is stopped (the injected fault) and the wait for it runs
                with host.frozen(pid):
                    r = pending.result()
                    assert r.status_code == 502 and "did not answer" in r.json()["message"], r.text
                    (rec,) = [x for x in all_sandboxes(api) if x["sandboxID"] == sid]
                    assert rec["state"] == "error" and "a kill tries again" in rec["error"], rec
                    assert host.qemu_pids(sid) == {pid}
                    # A restart finds it as it was left: listed as error, holding its namespace.
                    s.stop()
                    s.start()
                    (rec,) = [x for x in all_sandboxes(api) if x["sandboxID"] == sid]
                    assert rec["state"] == "error", rec
                    assert sid in host.sandbox_dirs(s.data_dir)
                    assert len(host.node_netns(s.data_dir)) == len(before[2]) + 1
            assert host.qemu_gone(sid)
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
            assert api.get(f"/sandboxes/{sid}").status_code == 404
            deadline = time.monotonic() + 10
            while host.node_netns(s.data_dir) != before[2] and time.monotonic() < deadline:
                time.sleep(0.1)
            after = (host.sandbox_dirs(s.data_dir), host.qemu_pids(str(s.data_dir)), host.node_netns(s.data_dir))
            assert after == before
    finally:
        s.kill_all()


def test_a_kill_whose_qemu_will_not_die_leaves_the_sandbox_listed_as_error_until_a_kill_succeeds(
        api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    (pid,) = host.qemu_pids(sid)
    with host.frozen(pid):
        r = api.delete(f"/sandboxes/{sid}")
        assert r.status_code == 500 and "did not exit after SIGKILL" in r.json()["message"], r.text
        (rec,) = [x for x in all_sandboxes(api) if x["sandboxID"] == sid]
        assert rec["state"] == "error" and "kill failed" in rec["error"], rec
        assert sid in host.sandbox_dirs(server.data_dir)
    assert host.qemu_gone(sid)
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.get(f"/sandboxes/{sid}").status_code == 404
    assert sid not in host.sandbox_dirs(server.data_dir)


def test_a_pool_shell_whose_qemu_died_is_destroyed_when_found(tmp_path: Path) -> None:
    """A ready shell whose QEMU died while it waited (OOM killer, crash) is skipped by the next
    create and destroyed: its namespace, slot and run dir go, and the pool makes a new one."""
    s = ServerProcess(tmp_path / "data", node_cidr(38), AENV_POOL_SIZE="2", AENV_SLOT_POOL_SIZE="0")
    s.start()
    try:
        with s.client() as api:
            first = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]

            def pool_ready(n: int) -> None:
                deadline = time.monotonic() + 120
                while api.get("/health/details").json()["poolReady"] != n and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert api.get("/health/details").json()["poolReady"] == n

            pool_ready(2)
            shells = host.sandbox_dirs(s.data_dir) - {first}
            assert len(shells) == 2
            for shell in shells:
                for pid in host.qemu_pids(shell):
                    os.kill(pid, signal.SIGKILL)
                assert host.qemu_gone(shell)
            second = api.post("/sandboxes", json={"templateID": "base"})
            assert second.status_code == 201, second.text
            assert run(api, second.json()["sandboxID"], "echo ok")["stdout"] == "ok\n"
            pool_ready(2)
            deadline = time.monotonic() + 10
            while host.sandbox_dirs(s.data_dir) & shells and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not host.sandbox_dirs(s.data_dir) & shells, "the dead shells' run dirs are removed"
            assert len(host.node_netns(s.data_dir)) == 4, "two sandboxes and two new shells, nothing more"
    finally:
        s.kill_all()


def test_concurrent_creates_do_not_pass_the_sandbox_limit(tmp_path: Path) -> None:
    """Creates admitted at once count each other while they start (no pool: each restores
    inline for a while): with AENV_MAX_SANDBOXES=2, four at once give two sandboxes and two 429s."""
    s = ServerProcess(tmp_path / "data", node_cidr(39), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_MAX_SANDBOXES="2")
    s.start()
    try:
        with s.client() as api:
            api.delete(f"/sandboxes/{api.post('/sandboxes', json={'templateID': 'base'}).json()['sandboxID']}")

            def create(_i: int) -> httpx.Response:
                with s.client() as c:
                    return c.post("/sandboxes", json={"templateID": "base"})

            with ThreadPoolExecutor(4) as ex:
                answers = list(ex.map(create, range(4)))
            assert sorted(r.status_code for r in answers) == [201, 201, 429, 429], [r.text for r in answers]
            assert len(all_sandboxes(api)) == 2
    finally:
        s.kill_all()


def test_qemu_dying_during_a_snapshot_is_noticed(tmp_path: Path) -> None:
    """The exit watcher acts on running sandboxes; a QEMU that dies while the sandbox is being
    snapshotted (injected fault: right after the capture) is noticed once the snapshot ends.
    The snapshot itself is complete and starts new sandboxes."""
    s = ServerProcess(tmp_path / "data", node_cidr(40), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_FAULTS="qemu_dies_after_capture")
    s.start()
    try:
        with s.client() as api:
            sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            run(api, sid, "echo kept > /home/user/f.txt")
            r = api.post(f"/sandboxes/{sid}/snapshots", json={})
            assert r.status_code == 201, r.text
            deadline = time.monotonic() + 10
            while api.get(f"/sandboxes/{sid}").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            info = api.get(f"/sandboxes/{sid}").json()
            assert info["state"] == "error" and "QEMU exited" in info["error"], info
            child = api.post("/sandboxes", json={"templateID": r.json()["snapshotID"]})
            assert child.status_code == 201, child.text
            assert run(api, child.json()["sandboxID"], "cat /home/user/f.txt")["stdout"] == "kept\n"
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        s.kill_all()


def test_a_qemu_that_stops_answering_is_killed_and_does_not_hold_up_the_node(tmp_path: Path) -> None:
    """A pause waits on QMP while it holds the node's repository lock. A QEMU that took the
    command and never answered (here: SIGSTOP; in the wild a frozen cgroup or a disk that
    hangs) froze every pause, snapshot, fork, resume and gc of the node for good. It is now
    killed after AENV_QMP_TIMEOUT (3 s here): its pause fails and the sandbox is failed, and
    another sandbox's pause goes through."""
    s = ServerProcess(tmp_path / "data", node_cidr(57), AENV_POOL_SIZE="2", AENV_QMP_TIMEOUT="3")
    s.start()
    try:
        with s.client() as api, ThreadPoolExecutor(1) as ex:
            hung, other = (api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"] for _ in range(2))
            (pid,) = host.qemu_pids(hung)
            os.kill(pid, signal.SIGSTOP)
            first = ex.submit(lambda: s.client().post(f"/sandboxes/{hung}/pause", timeout=120))
            time.sleep(0.5)  # its pause holds the repository lock, waiting on the stopped QEMU
            r = api.post(f"/sandboxes/{other}/pause", timeout=120)
            assert r.status_code == 204, r.text
            r = first.result(120)
            assert r.status_code >= 500 and "AENV_QMP_TIMEOUT" in r.json()["message"], r.text
            assert host.qemu_gone(hung), "the QEMU that did not answer is killed"
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and api.get(f"/sandboxes/{hung}").status_code != 410:
                time.sleep(0.2)
            assert api.get(f"/sandboxes/{hung}").status_code == 410  # failed, with the reason
            r = api.post(f"/sandboxes/{other}/resume")
            assert r.status_code == 201, r.text
            assert run(api, other, "echo back")["stdout"] == "back\n"
    finally:
        s.kill_all()
