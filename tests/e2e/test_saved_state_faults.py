"""Data safety of pause, snapshot and fork: the server SIGKILLed at injected crash points,
shutdown with pause-on-stop, a paused sandbox across a crash, a full disk while pausing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from agentenv.config import Settings
from agentenv.storage.memory_layers import DIRECT_MIN_BYTES
from tests.e2e.conftest import run
from tests.e2e.test_saved_states import COUNTER, counter, state
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess, all_sandboxes


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One node restarted by every test here, with a different AENV_FAULTS each time."""
    s = ServerProcess(tmp_path_factory.mktemp("crash") / "data", node_cidr(20), AENV_POOL_SIZE="0")
    s.start()
    yield s
    if s.proc is None:
        s.env["AENV_FAULTS"] = ""
        s.start()
    s.kill_all()


def restart(node: ServerProcess, *, faults: str = "", sig: int = signal.SIGKILL, **env: str) -> None:
    if node.proc is not None:
        node.stop(sig)
    node.env.update({"AENV_FAULTS": faults, **env})
    node.start()


def wait_for_log(node: ServerProcess, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in node.log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"server never logged {text!r}")


def interrupt(node: ServerProcess, api: httpx.Client, route: str, body: dict, point: str) -> None:
    """Send a request that stops at crash point ``point`` (it never answers) and wait until
    the server has reached it; the caller then SIGKILLs the server."""
    try:
        api.post(route, json=body, timeout=3)
    except httpx.ReadTimeout:
        pass
    wait_for_log(node, f"crash point {point} reached")


def busy_sandbox(api: httpx.Client, **options: object) -> str:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 900, **options}).json()["sandboxID"]
    run(api, sid, COUNTER)
    run(api, sid, "echo before > /home/user/f.txt; head -c 4194304 /dev/urandom > /dev/shm/r")
    return sid


def sandbox_top(node: ServerProcess, sid: str) -> str:
    """The overlay the sandbox's record says its VM writes to."""
    with sqlite3.connect(node.data_dir / "state.sqlite") as db:
        (top,) = db.execute("SELECT disk_path FROM sandboxes WHERE id = ?", (sid,)).fetchone()
    return top


def repository_is_clean(node: ServerProcess) -> None:
    repo = node.data_dir / "repository"
    assert list((repo / "staging").iterdir()) == [], "unpublished files left in staging"


@pytest.mark.parametrize("point, route, body", [
    ("pause_before_publish", "pause", {}),
    ("pause_after_publish", "pause", {}),
    ("snapshot_before_switch", "snapshots", {"name": "crashed"}),  # a new top made, not yet used
    ("snapshot_after_disk", "snapshots", {"name": "crashed"}),
    ("snapshot_before_publish", "snapshots", {"name": "crashed"}),
    ("fork_before_publish", "fork", {"count": 2}),
])
def test_server_killed_mid_operation_keeps_the_previous_state(node: ServerProcess, point: str, route: str,
                                                              body: dict) -> None:
    restart(node, faults=point)
    with node.client() as api:
        sid = busy_sandbox(api)
        manifests_before = sorted(p.name for p in (node.data_dir / "repository" / "manifests").iterdir())
        interrupt(node, api, f"/sandboxes/{sid}/{route}", body, point)
    log_at = node.log.stat().st_size
    restart(node)  # SIGKILL at the crash point, then a clean start
    with node.client() as api:
        assert state(api, sid) == "running", api.get(f"/sandboxes/{sid}").json()
        # The adopted VM writes to the top the snapshot switched to (not the one it removed):
        # the start's gc finds every overlay and keeps only the layers in use.
        assert "gc keeps every disk layer" not in node.log.read_bytes()[log_at:].decode(errors="replace")
        top = Path(sandbox_top(node, sid))
        assert sorted(p.name for p in top.parent.glob("disk*.qcow2")) == [top.name], "an unused overlay is left"
        c = counter(api, sid)
        time.sleep(0.3)
        assert counter(api, sid) > c, "the sandbox must run on after the interrupted operation"
        run(api, sid, "echo after >> /home/user/f.txt")
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\nafter\n"
        repository_is_clean(node)
        manifests = sorted(p.name for p in (node.data_dir / "repository" / "manifests").iterdir())
        assert manifests == manifests_before, "an interrupted operation must publish nothing"
        assert [s["sandboxID"] for s in all_sandboxes(api)] == [sid], "no half-made children"
        # The disk it writes to after recovery is the right one: it survives a pause/resume.
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\nafter\n"
        api.delete(f"/sandboxes/{sid}")


@pytest.mark.parametrize("point, linger, outcome, sig", [
    # a restore into a new QEMU: loaded, its guest not yet run, its slot not yet recorded
    ("restore_before_run", "0", "paused", signal.SIGKILL),
    # ... its guest running on the sandbox's own disk: that VM is the sandbox now
    ("start_after_restore", "0", "adopted", signal.SIGKILL),
    ("wake_before_cont", "60", "adopted", signal.SIGKILL),  # a parked VM (orchestrator/parking.py), not yet continued
    ("wake_after_cont", "60", "adopted", signal.SIGKILL),  # ... continued, its guest not yet told the clock
    # A graceful stop cancels the requests still running after its grace period (10 s): a
    # resume whose VM was recorded is then left as a crash leaves it, not rolled back to a
    # saved state its disk may have moved on from.
    ("start_after_restore", "0", "adopted", signal.SIGTERM),
    ("wake_before_cont", "60", "adopted", signal.SIGTERM),
], ids=["restore_before_run", "start_after_restore", "wake_before_cont", "wake_after_cont",
        "start_after_restore-sigterm", "wake_before_cont-sigterm"])
def test_server_killed_mid_resume_loses_nothing(node: ServerProcess, point: str, linger: str, outcome: str,
                                                sig: int) -> None:
    restart(node, faults=point, AENV_PAUSE_LINGER_S=linger)
    try:
        with node.client() as api:
            sid = busy_sandbox(api)
            # Paused with 5 s left: by the time the server is back, the old time to live is
            # over, and only the resume's own (600 s) keeps a re-adopted VM from the reaper.
            assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 5}).status_code == 204
            old_end = time.time() + 5
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            interrupt(node, api, f"/sandboxes/{sid}/resume", {"timeout": 600}, point)
            vm = host.qemu_pids(sid)  # the parked VM, or the one the resume started
            assert vm
        restart(node, sig=sig, AENV_PAUSE_LINGER_S=linger)  # stopped at the crash point, then a clean start
        with node.client() as api:
            if outcome == "paused":
                assert state(api, sid) == "paused", "the restore was cut short: the saved state stands"
                assert host.qemu_pids(sid) == set()
                assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600}).status_code == 201
            else:
                assert state(api, sid) == "running", "the VM being resumed is re-adopted"
                assert host.qemu_pids(sid) == vm
            time.sleep(max(0.0, old_end + 2 - time.time()))  # the reaper looks twice a second
            assert state(api, sid) == "running", "a resumed sandbox is not killed for its old time to live"
            c = counter(api, sid)
            time.sleep(0.3)
            assert counter(api, sid) > c
            assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\n"
            assert abs(float(run(api, sid, "date +%s.%N")["stdout"]) - time.time()) < 1.5
            repository_is_clean(node)
            api.delete(f"/sandboxes/{sid}")
    finally:
        node.env["AENV_PAUSE_LINGER_S"] = "0"  # the other tests here restart with the default of the test nodes


def test_a_resume_without_memory_cut_short_does_not_bring_the_old_memory_back(node: ServerProcess) -> None:
    """``memory: false`` on the resume of a sandbox paused with its memory boots its disk, and
    the booted kernel writes to it at once. The server dies then: the sandbox comes back paused
    without its memory, and the next resume boots the disk again. Before, it came back with the
    memory, which a resume restored over the disk the boot had written to."""
    restart(node, faults="start_after_restore")
    with node.client() as api:
        sid = busy_sandbox(api)
        run(api, sid, "sync")
        boot = run(api, sid, "cat /proc/sys/kernel/random/boot_id")["stdout"]
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        interrupt(node, api, f"/sandboxes/{sid}/resume", {"timeout": 600, "memory": False}, "start_after_restore")
    restart(node)
    with node.client() as api:
        assert state(api, sid) == "paused"
        assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600}).status_code == 201
        assert run(api, sid, "cat /proc/sys/kernel/random/boot_id")["stdout"] != boot, "its disk is booted"
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\n"
        repository_is_clean(node)
        api.delete(f"/sandboxes/{sid}")


def test_a_resume_whose_vm_is_lost_with_the_server_keeps_the_sandboxs_files(node: ServerProcess) -> None:
    """A host crash while a resume's guest runs on the sandbox's own disk (server and QEMU
    gone): the saved memory no longer matches that disk, so the sandbox comes back paused with
    its files and boots its disk on resume (processes gone, files there), not its old memory
    over a disk that moved on."""
    restart(node, faults="start_after_restore")
    with node.client() as api:
        sid = busy_sandbox(api)
        boot_id = run(api, sid, "sync; cat /proc/sys/kernel/random/boot_id")["stdout"]
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        interrupt(node, api, f"/sandboxes/{sid}/resume", {"timeout": 600}, "start_after_restore")
    vm = host.qemu_pids(sid)
    assert vm
    node.stop(signal.SIGKILL)
    for pid in vm:
        os.kill(pid, signal.SIGKILL)
    assert host.qemu_gone(sid)
    restart(node)
    with node.client() as api:
        assert state(api, sid) == "paused", api.get(f"/sandboxes/{sid}").json()
        assert api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600}).status_code == 201
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\n"
        assert run(api, sid, "cat /proc/sys/kernel/random/boot_id")["stdout"] != boot_id, "its disk is booted"
        assert run(api, sid, "ps -eo args | grep -c '[w]hile true'")["stdout"] == "0\n", "the counter ran on"
        repository_is_clean(node)
        api.delete(f"/sandboxes/{sid}")


def test_snapshot_published_before_a_crash_is_complete_and_usable(node: ServerProcess) -> None:
    restart(node, faults="snapshot_after_publish")
    with node.client() as api:
        sid = busy_sandbox(api)
        interrupt(node, api, f"/sandboxes/{sid}/snapshots", {"name": "published"}, "snapshot_after_publish")
    restart(node)
    with node.client() as api:
        assert state(api, sid) == "running"
        assert [s["names"] for s in api.get("/snapshots").json()] == [["published"]]
        r = api.post("/sandboxes", json={"templateID": "published"})
        assert r.status_code == 201, r.text
        new = r.json()["sandboxID"]
        assert run(api, new, "cat /home/user/f.txt")["stdout"] == "before\n"
        for s in (sid, new):
            api.delete(f"/sandboxes/{s}")
        api.delete("/snapshots/published")
        repository_is_clean(node)


def test_a_sandbox_adopted_after_its_snapshot_goes_on_from_its_new_disk_top(node: ServerProcess) -> None:
    """A snapshot moves the sandbox onto a new disk top; a server crash afterwards re-adopts the
    VM with that top (the record's), and later snapshots and pauses see every write."""
    restart(node)
    with node.client() as api:
        sid = busy_sandbox(api)
        snap = api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
        run(api, sid, "echo after > /home/user/f.txt")
    restart(node)
    with node.client() as api:
        assert state(api, sid) == "running"
        again = api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
        child = api.post("/sandboxes", json={"templateID": again}).json()["sandboxID"]
        assert run(api, child, "cat /home/user/f.txt")["stdout"] == "after\n"
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "after\n"
        for s in (sid, child):
            api.delete(f"/sandboxes/{s}")
        for s in (snap, again):
            api.delete(f"/snapshots/{s}")
        repository_is_clean(node)


def test_paused_sandbox_survives_a_server_crash(node: ServerProcess) -> None:
    restart(node)
    with node.client() as api:
        sid = busy_sandbox(api)
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
    restart(node, sig=signal.SIGKILL)
    with node.client() as api:
        assert state(api, sid) == "paused"
        assert host.qemu_pids(sid) == set()
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\n"
        api.delete(f"/sandboxes/{sid}")


def test_paused_sandboxes_and_snapshots_survive_a_host_reboot(node: ServerProcess) -> None:
    """A reboot kills every QEMU and empties tmpfs, where template memory files live. Paused
    sandboxes and named snapshots keep only the pages they changed, over their template
    snapshot: it comes back from its copy on the data disk (no new boot, which would not
    match their disks), and they resume with memory and files intact."""
    restart(node)
    with node.client() as api:
        sid = busy_sandbox(api)
        run(api, sid, "echo 7 > /tmp/mem-only")
        assert api.post(f"/sandboxes/{sid}/snapshots", json={"name": "pre-reboot"}).status_code == 201
        c = counter(api, sid)
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        lost = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    node.stop(signal.SIGKILL)  # the reboot: the server, every QEMU and tmpfs go
    for pid in host.qemu_pids(str(node.data_dir)):
        os.kill(pid, signal.SIGKILL)
    mem_dir = Settings(data_dir=node.data_dir).mem_dir
    assert list(mem_dir.glob("*.mem")), "the template memory file should be on tmpfs"
    shutil.rmtree(mem_dir)
    boots = node.log.read_text().count("template base snapshotted")
    restart(node)
    with node.client() as api:
        assert api.get(f"/sandboxes/{lost}").status_code == 410  # it was running: it is gone, said so
        assert state(api, sid) == "paused"
        r = api.post(f"/sandboxes/{sid}/resume")
        assert r.status_code == 201, r.text
        assert counter(api, sid) >= c
        assert run(api, sid, "cat /tmp/mem-only /home/user/f.txt")["stdout"] == "7\nbefore\n"
        r = api.post("/sandboxes", json={"templateID": "pre-reboot", "timeout": 120})
        assert r.status_code == 201, r.text
        child = r.json()["sandboxID"]
        assert run(api, child, "cat /tmp/mem-only")["stdout"] == "7\n"
        fresh = api.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
        assert run(api, fresh, "cat /tmp/mem-only 2>/dev/null; echo ok")["stdout"] == "ok\n"
        for x in (sid, child, fresh, lost):
            api.delete(f"/sandboxes/{x}")
        assert api.delete("/snapshots/pre-reboot").status_code == 204
    log = node.log.read_text()
    assert log.count("template base snapshotted") == boots, "the template must not be booted again"
    assert "restored from" in log


def test_sigterm_with_pause_on_stop_pauses_and_a_restart_resumes(node: ServerProcess) -> None:
    restart(node, AENV_PAUSE_ON_STOP="1")
    with node.client() as api:
        sid = busy_sandbox(api)
        c = counter(api, sid)
    restart(node, sig=signal.SIGTERM, AENV_PAUSE_ON_STOP="0")
    with node.client() as api:
        assert state(api, sid) == "paused"
        assert host.qemu_pids(sid) == set()
        r = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300})
        assert r.status_code == 201, r.text
        assert counter(api, sid) >= c
        assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\n"
        api.delete(f"/sandboxes/{sid}")


@pytest.mark.parametrize("linger", ["0", "60"], ids=["vm-freed", "vm-parked"])
def test_full_disk_during_pause_keeps_the_sandbox_running(tmp_path_factory: pytest.TempPathFactory,
                                                          linger: str) -> None:
    """Both ways a pause writes its memory layer: through the page cache (the VM is freed at
    once), and with direct I/O (the VM is parked, orchestrator/parking.py, and the layer is
    over memory_layers.DIRECT_MIN_BYTES)."""
    mnt = tmp_path_factory.mktemp("pausefull")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320m", "tmpfs", str(mnt)], check=True)
    s = ServerProcess(mnt / "data", node_cidr(21), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0",
                      AENV_PAUSE_LINGER_S=linger)
    try:
        s.start()
        with s.client() as api:
            sid = busy_sandbox(api, autoPause=True)
            run(api, sid, f"head -c {DIRECT_MIN_BYTES + (8 << 20)} /dev/urandom > /dev/shm/big")
            filler = s.data_dir / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=600"], capture_output=True)
            with open(filler, "r+b") as f:  # leave 4 MiB: the layer write itself runs out of space
                f.truncate(max(0, filler.stat().st_size - (4 << 20)))
            r = api.post(f"/sandboxes/{sid}/pause")
            assert r.status_code == 507, r.text
            assert "space" in r.json()["message"]
            assert state(api, sid) == "running"
            c = counter(api, sid)
            time.sleep(0.3)
            assert counter(api, sid) > c
            assert list((s.data_dir / "repository" / "staging").iterdir()) == []
            assert list((s.data_dir / "repository" / "manifests").iterdir()) == []
            if linger == "0":
                # The timeout's auto-pause fails the same way: retried with a growing delay,
                # the sandbox running meanwhile, and done once there is room.
                assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1}).status_code == 204
                time.sleep(8)
                retries = s.log.read_text().count(f"reaper could not pause {sid}")
                assert 1 <= retries <= 3, f"{retries} tries in 8 s"
                assert "retrying in 10 s" in s.log.read_text()
                assert state(api, sid) == "running" and counter(api, sid) > c
                filler.unlink()
                deadline = time.monotonic() + 30
                while state(api, sid) != "paused" and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert state(api, sid) == "paused", "auto-paused once there is room"
            else:
                filler.unlink()
                assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
            assert run(api, sid, "cat /home/user/f.txt")["stdout"] == "before\n"
    finally:
        s.kill_all()  # also when an assertion failed: no VM or tmpfs memory file outlives the test
        subprocess.run(["umount", "-l", str(mnt)], check=False)




def test_a_store_that_fails_leaves_the_sandbox_running_in_memory_as_on_disk(node: ServerProcess) -> None:
    """The store fails (a) when the pause is begun and (b) when it is published, after the
    capture. Either way the pause did not happen: the sandbox runs on (its processes, its
    memory), says ``running``, leaves no pause manifest, and pauses and resumes once the store
    is writable again. Before, (a) left it ``pausing`` for good and (b) ``paused`` with its
    stopped VM still attached."""
    restart(node)
    with node.client() as api:
        sid = busy_sandbox(api)
        with host.store_unwritable(node.data_dir):
            r = api.post(f"/sandboxes/{sid}/pause")
        assert r.status_code == 500 and "sandbox store" in r.json()["message"], r.text
        assert state(api, sid) == "running"
        c = counter(api, sid)
        # (b): 200 MiB more to save makes the capture long enough to make the store fail
        # under it once the pause is recorded as begun.
        run(api, sid, "head -c 209715200 /dev/zero | tr '\\0' x > /dev/shm/big")
        with ThreadPoolExecutor(1) as threads:
            pending = threads.submit(lambda: node.client().post(f"/sandboxes/{sid}/pause"))
            while not pending.done() and not api.get("/sandboxes", params={"state": "pausing"}).json():
                time.sleep(0.002)
            assert not pending.done(), "the pause ended before the test saw it begin"
            with host.store_unwritable(node.data_dir):
                r = pending.result()
        assert r.status_code == 500 and "sandbox store" in r.json()["message"], r.text
        assert state(api, sid) == "running"
        time.sleep(0.3)
        assert counter(api, sid) > c
        assert [p for p in (node.data_dir / "repository" / "manifests").glob("*.json")
                if f'"{sid}"' in p.read_text()] == []
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
        assert run(api, sid, "cat /home/user/f.txt; wc -c < /dev/shm/big")["stdout"] == "before\n209715200\n"
        api.delete(f"/sandboxes/{sid}")


def _qmp(pid: int, command: str) -> None:
    """Send one QMP command to a QEMU ourselves (the server is stopped: the socket is free)."""
    argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    path = argv[argv.index(b"-qmp") + 1].decode().removeprefix("unix:").split(",")[0]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        f = sock.makefile("rwb")
        f.readline()  # the greeting
        for cmd in ("qmp_capabilities", command):
            f.write(json.dumps({"execute": cmd}).encode() + b"\n")
            f.flush()
            while b'"return"' not in (line := f.readline()):
                assert b'"error"' not in line, line


def test_a_running_sandbox_whose_vm_was_left_stopped_is_continued_by_the_next_start(node: ServerProcess) -> None:
    """A stop (or crash) that cuts a pause short after its capture stopped the VM and before it
    continued it leaves a sandbox recorded running on a stopped VM: re-adopted as it was, it
    was listed running while its guest never answered. The next start continues it."""
    restart(node)
    with node.client() as api:
        sid = busy_sandbox(api)
    node.stop(signal.SIGTERM)  # running sandboxes are left running for the next start
    (pid,) = host.qemu_pids(sid)
    _qmp(pid, "stop")  # as the cut-short pause left it
    restart(node)
    with node.client() as api:
        assert state(api, sid) == "running"
        c = counter(api, sid)
        time.sleep(0.3)
        assert counter(api, sid) > c
        assert host.qemu_pids(sid) == {pid}, "the same VM, continued"
        api.delete(f"/sandboxes/{sid}")


def test_disk_chain_is_bounded_by_streaming(node: ServerProcess) -> None:
    """Each snapshot seals a disk layer under the sandbox; past AENV_MAX_DISK_LAYERS the chain
    is streamed into the sandbox's overlay while it runs, and every snapshot stays usable."""
    from agentenv.storage import backing_chain

    restart(node, AENV_MAX_DISK_LAYERS="2")
    with node.client() as api:
        sid = busy_sandbox(api)
        snaps = []
        for i in range(5):
            run(api, sid, f"echo {i} > /home/user/gen{i}")
            snaps.append(api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"])
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204  # waits for the stream
        top = Path(sandbox_top(node, sid))
        layers = node.data_dir / "repository" / "layers"
        depth = sum(1 for p in backing_chain(top) if p.parent == layers)
        assert depth <= 3, f"disk chain not bounded: {depth} repository layers under {top}"
        assert sorted(p.name for p in top.parent.glob("disk*.qcow2")) == [top.name], "sealed tops left in the run dir"
        assert api.post(f"/sandboxes/{sid}/resume").status_code == 201
        assert run(api, sid, "cat /home/user/gen0 /home/user/gen4")["stdout"] == "0\n4\n"
        first = api.post("/sandboxes", json={"templateID": snaps[0]}).json()["sandboxID"]
        assert run(api, first, "cat /home/user/gen0; ls /home/user | grep -c gen")["stdout"] == "0\n1\n"
        for s in (sid, first):
            api.delete(f"/sandboxes/{s}")
        for snap in snaps:
            api.delete(f"/snapshots/{snap}")
    restart(node, AENV_MAX_DISK_LAYERS="16")


def test_a_timeout_action_that_hangs_holds_up_no_other_sandbox(node: ServerProcess) -> None:
    """The reaper pauses or kills sandboxes past their timeout a few at a time: one whose
    auto-pause hangs (injected: it stops at a crash point, holding its lock) does not keep the
    next from being killed at its own timeout (the reaper awaited each in turn)."""
    restart(node, faults="pause_before_publish")
    with node.client() as api:
        hung = api.post("/sandboxes", json={"templateID": "base", "timeout": 1, "autoPause": True}).json()["sandboxID"]
        wait_for_log(node, "crash point pause_before_publish reached", timeout=60)
        other = api.post("/sandboxes", json={"templateID": "base", "timeout": 1}).json()["sandboxID"]
        deadline = time.monotonic() + 30
        while api.get(f"/sandboxes/{other}").status_code != 404 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert api.get(f"/sandboxes/{other}").status_code == 404, "killed at its timeout"
    restart(node)  # SIGKILL at the crash point, then a clean start: the pause never happened
    with node.client() as api:
        assert state(api, hung) == "running"
        api.delete(f"/sandboxes/{hung}")


def test_a_network_update_the_store_refuses_changes_nothing_across_a_restart(node: ServerProcess) -> None:
    """PUT /sandboxes/{id}/network writes the record, then the rules. A store that fails
    leaves the namespace's rules as the record says (before, the rules changed and the record
    did not: the next restart or resume went back to the old ones); recovery puts the record's
    rules back whatever a change cut short left."""
    from tests.e2e.conftest import ns_addr

    def egress(ns: str) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "chain", "ip", "aenv", "egress"],
                              capture_output=True, text=True).stdout

    restart(node)
    with node.client() as api:
        sid = api.post("/sandboxes", json={"templateID": "base", "network": {"denyOut": ["203.0.113.0/24"]}}
                       ).json()["sandboxID"]
        ns, _ = ns_addr(node, sid)
        with host.store_unwritable(node.data_dir):
            r = api.put(f"/sandboxes/{sid}/network", json={"denyOut": ["198.51.100.0/24"]})
        assert r.status_code == 500 and "sandbox store" in r.json()["message"], r.text
        assert "203.0.113.0/24" in egress(ns) and "198.51.100.0/24" not in egress(ns)
        # a change cut short by a crash (here made by hand) is undone by the next start
        subprocess.run(["ip", "netns", "exec", ns, "nft", "flush", "chain", "ip", "aenv", "egress"], check=True)
        restart(node)
        assert "203.0.113.0/24" in egress(ns)
        assert api.put(f"/sandboxes/{sid}/network", json={"denyOut": ["198.51.100.0/24"]}).status_code == 204
        assert "198.51.100.0/24" in egress(ns) and "203.0.113.0/24" not in egress(ns)
        assert api.get(f"/sandboxes/{sid}").json()["network"]["denyOut"] == ["198.51.100.0/24"]
        api.delete(f"/sandboxes/{sid}")
