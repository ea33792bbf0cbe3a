"""Pause, resume, named snapshots and fork, on real microVMs (issue #3)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.server import ServerProcess, all_sandboxes

# The counter appends: a file rewritten in place (truncate, then write) reads empty when the
# sandbox is frozen, or read, between the two.
COUNTER = ("nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i >> /tmp/counter; sleep 0.05; done' "
           ">/dev/null 2>&1 & echo $!")


def counter(api: httpx.Client, sid: str) -> int:
    return int(run(api, sid, "tail -n1 /tmp/counter")["stdout"])


def state(api: httpx.Client, sid: str) -> str:
    return api.get(f"/sandboxes/{sid}").json()["state"]


@pytest.fixture
def busy(api: httpx.Client) -> Iterator[tuple[str, str, str]]:
    """A sandbox with a counting process, a file on disk and 20 MiB of random data in RAM
    (tmpfs); yields (id, counter pid, md5 of the RAM data)."""
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    pid = run(api, sid, COUNTER)["stdout"].strip()
    out = run(api, sid, "echo on-disk > /home/user/kept.txt; head -c 20971520 /dev/urandom > /dev/shm/blob; "
                        "md5sum < /dev/shm/blob")["stdout"].split()[0]
    yield sid, pid, out
    api.delete(f"/sandboxes/{sid}")


def test_pause_releases_the_vm_and_resume_keeps_processes_memory_and_files(
        api: httpx.Client, busy: tuple[str, str, str]) -> None:
    sid, pid, md5 = busy
    boot_id = run(api, sid, "cat /proc/sys/kernel/random/boot_id")["stdout"]
    assert counter(api, sid) > 0
    r = api.post(f"/sandboxes/{sid}/pause")
    assert r.status_code == 204, r.text
    assert state(api, sid) == "paused"
    assert host.qemu_gone(sid), "a paused sandbox must not keep its QEMU"
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and "paused" in r.json()["message"]
    assert api.post(f"/sandboxes/{sid}/pause").status_code == 409  # already paused
    time.sleep(2)
    r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 600})
    assert r.status_code == 201, r.text
    assert r.json()["sandboxID"] == sid
    assert state(api, sid) == "running"
    assert api.post(f"/sandboxes/{sid}/resume").status_code == 409  # running
    c1 = counter(api, sid)
    time.sleep(0.5)
    assert counter(api, sid) > c1, "the counting process must go on after resume"
    assert run(api, sid, f"kill -0 {pid} && echo alive")["stdout"] == "alive\n"
    assert run(api, sid, "cat /home/user/kept.txt")["stdout"] == "on-disk\n"
    assert run(api, sid, "md5sum < /dev/shm/blob")["stdout"].split()[0] == md5
    assert run(api, sid, "cat /proc/sys/kernel/random/boot_id")["stdout"] == boot_id
    # The guest clock was set on resume: it did not stand still for the 2 s it was paused.
    guest_now = float(run(api, sid, "date +%s.%N")["stdout"])
    assert abs(guest_now - time.time()) < 3


def test_connect_resumes_a_paused_sandbox_and_only_extends_a_running_one(api: httpx.Client,
                                                                         sandbox: str) -> None:
    end = api.get(f"/sandboxes/{sandbox}").json()["endAt"]
    r = api.post(f"/sandboxes/{sandbox}/connect", json={"timeout": 5})
    assert r.status_code == 200, r.text
    assert api.get(f"/sandboxes/{sandbox}").json()["endAt"] == end  # never shortened
    assert api.post(f"/sandboxes/{sandbox}/pause").status_code == 204
    r = api.post(f"/v2/sandboxes/{sandbox}/connect", json={"timeout": 600})
    assert r.status_code == 201, r.text
    assert r.json()["envdAccessToken"]
    assert run(api, sandbox, "echo back")["stdout"] == "back\n"


def test_connects_that_arrive_during_a_pause_all_succeed(api: httpx.Client, sandbox: str) -> None:
    """Several workers connect to a sandbox while it is being paused (the reaper's auto-pause,
    a retried create): each waited for the pause, saw it paused, and all but the first then
    found it running and got 409. Connecting to a running sandbox is not an error."""
    with ThreadPoolExecutor(4) as pool:
        pausing = pool.submit(api.post, f"/sandboxes/{sandbox}/pause")
        deadline = time.monotonic() + 10
        while state(api, sandbox) != "pausing" and not pausing.done() and time.monotonic() < deadline:
            pass
        connects = [pool.submit(api.post, f"/sandboxes/{sandbox}/connect", json={"timeout": 600}) for _ in range(3)]
        assert pausing.result().status_code == 204
        codes = sorted(c.result().status_code for c in connects)
    assert codes == [200, 200, 201], codes  # one of them resumed it
    assert state(api, sandbox) == "running"
    assert run(api, sandbox, "echo back")["stdout"] == "back\n"


def test_fifty_pause_resume_cycles_lose_nothing(api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 900}).json()["sandboxID"]
    try:
        run(api, sid, COUNTER)
        last = 0
        for i in range(50):
            run(api, sid, f"mkdir -p /home/user/cycles && echo {i} > /home/user/cycles/{i}")
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204, i
            r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 900})
            assert r.status_code == 201, (i, r.text)
            out = run(api, sid, "tail -n1 /tmp/counter; cat /home/user/cycles/* | sort -n | tr '\\n' ' '")["stdout"]
            value, files = out.split("\n", 1)
            assert int(value) >= last, (i, value, last)
            last = int(value)
            assert files.split() == [str(k) for k in range(i + 1)], (i, files)
        time.sleep(0.3)
        assert counter(api, sid) > last
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_fork_children_inherit_state_and_are_independent(api: httpx.Client, busy: tuple[str, str, str]) -> None:
    sid, _pid, md5 = busy
    run(api, sid, "echo before-fork > /home/user/shared.txt")
    api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 700})
    r = api.post(f"/sandboxes/{sid}/fork", json={"count": 3})
    assert r.status_code == 201, r.text
    items = r.json()
    assert len(items) == 3 and all("sandbox" in x for x in items), items
    kids = [x["sandbox"]["sandboxID"] for x in items]
    try:
        assert len(set(kids) | {sid}) == 4
        assert state(api, sid) == "running"
        run(api, sid, "echo source-after > /home/user/shared.txt")
        randoms = set()
        for k in kids:
            info = api.get(f"/sandboxes/{k}").json()
            assert info["state"] == "running"
            assert info["envdAccessToken"] != api.get(f"/sandboxes/{sid}").json()["envdAccessToken"]
            out = run(api, k, "cat /home/user/shared.txt; md5sum < /dev/shm/blob; echo $E2B_SANDBOX_ID; "
                              "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")["stdout"].split("\n")
            assert out[0] == "before-fork", out
            assert out[1].split()[0] == md5
            assert out[2] == k, "each child has its own identity"
            randoms.add(out[3])
            assert counter(api, k) > 0  # the counting process was forked too
            end = api.get(f"/sandboxes/{k}").json()["endAt"]
            assert end > api.get(f"/sandboxes/{sid}").json()["startedAt"]
        assert len(randoms) == 3, "children must not share their random state"
        run(api, kids[0], "echo child0 > /home/user/shared.txt")
        assert run(api, kids[1], "cat /home/user/shared.txt")["stdout"] == "before-fork\n"
        assert run(api, sid, "cat /home/user/shared.txt")["stdout"] == "source-after\n"
    finally:
        for k in kids:
            api.delete(f"/sandboxes/{k}")


def test_fork_count_is_validated(api: httpx.Client, sandbox: str) -> None:
    for count in (0, 21):
        r = api.post(f"/sandboxes/{sandbox}/fork", json={"count": count})
        assert r.status_code == 400 and "count" in r.json()["message"]
    assert api.post("/sandboxes/inope/fork", json={"count": 1}).status_code == 404


def test_a_fork_retried_with_an_idempotency_key_makes_its_children_once(api: httpx.Client) -> None:
    """A trainer (or `aenv fork` on Ctrl-C) that lost a fork's answer asks again with the same
    key: it gets the children the first request made, concurrently or later, never new ones."""
    key = f"fork-{time.time_ns()}"
    parent = api.post("/sandboxes", json={"templateID": "base", "metadata": {"k": key},
                                          "network": {"allowPublicTraffic": False}}).json()
    sandbox = parent["sandboxID"]
    with ThreadPoolExecutor(2) as ex:
        answers = list(ex.map(lambda _: api.post(f"/sandboxes/{sandbox}/fork", json={"count": 2},
                                                 headers={"Idempotency-Key": key}), range(2)))
    assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
    kids = [sorted(x["sandbox"]["sandboxID"] for x in r.json()) for r in answers]
    try:
        assert kids[0] == kids[1] and len(kids[0]) == 2
        # A private sandbox's children each get a traffic token of their own.
        tokens = {x["sandbox"]["trafficAccessToken"] for x in answers[0].json()} | {parent["trafficAccessToken"]}
        assert len(tokens) == 3, tokens
        assert sorted(r.headers.get("idempotent-replayed", "") for r in answers) == ["", "true"]
        mine = {s["sandboxID"] for s in api.get("/sandboxes", params={"metadata": f"k={key}"}).json()} - {sandbox}
        assert mine == set(kids[0]), "a retried fork must not make more children"
        r = api.post(f"/sandboxes/{sandbox}/fork", json={"count": 3}, headers={"Idempotency-Key": key})
        assert r.status_code == 422 and "different fork request" in r.json()["message"]
        assert api.delete(f"/sandboxes/{kids[0][0]}").status_code == 204
        r = api.post(f"/sandboxes/{sandbox}/fork", json={"count": 2}, headers={"Idempotency-Key": key})
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
        assert [x["sandbox"]["sandboxID"] for x in r.json()] == [kids[0][1]]  # the children still alive
    finally:
        for k in [*kids[0], sandbox]:
            api.delete(f"/sandboxes/{k}")


def test_named_snapshot_starts_new_sandboxes_and_outlives_its_source(api: httpx.Client,
                                                                    server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "metadata": {"team": "rl"}}).json()["sandboxID"]
    run(api, sid, "echo snap-content > /home/user/s.txt; echo 41 > /tmp/mem-only")
    r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "e2e-snap"})
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["names"] == ["e2e-snap"] and snap["snapshotID"]
    assert api.post(f"/sandboxes/{sid}/snapshots", json={"name": "bad name!"}).status_code == 400
    assert api.post(f"/sandboxes/{sid}/snapshots", json={"name": "base"}).status_code == 400  # a template's
    run(api, sid, "echo later > /home/user/s.txt")
    api.delete(f"/sandboxes/{sid}")
    listed = api.get("/snapshots").json()
    assert [s["snapshotID"] for s in listed if s["names"] == ["e2e-snap"]] == [snap["snapshotID"]]
    made = []
    try:
        for ref in ("e2e-snap", snap["snapshotID"]):
            r = api.post("/sandboxes", json={"templateID": ref, "timeout": 300})
            assert r.status_code == 201, r.text
            new = r.json()["sandboxID"]
            made.append(new)
            assert run(api, new, "cat /home/user/s.txt /tmp/mem-only")["stdout"] == "snap-content\n41\n"
            assert api.get(f"/sandboxes/{new}").json()["metadata"] == {"team": "rl"}
        run(api, made[0], "echo mine > /home/user/s.txt")
        assert run(api, made[1], "cat /home/user/s.txt")["stdout"] == "snap-content\n"
    finally:
        for m in made:
            api.delete(f"/sandboxes/{m}")
    assert api.delete("/snapshots/e2e-snap").status_code == 204
    assert api.delete("/snapshots/e2e-snap").status_code == 404
    assert api.post("/sandboxes", json={"templateID": "e2e-snap"}).status_code == 404


def test_two_snapshots_given_one_name_at_once_leave_it_on_the_newer_one(api: httpx.Client) -> None:
    """A name in use moves to the new snapshot; two snapshots named alike at the same moment
    (two workers of a trainer, say) must leave it on exactly one of them, the newer, with
    the other still there by its id: never both holding it, nor neither."""
    a, b = (api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"] for _ in range(2))
    made: list[str] = []
    snaps: list[dict] = []
    try:
        for sid in (a, b):
            run(api, sid, f"echo {sid} > /home/user/who.txt")
        with ThreadPoolExecutor(2) as ex:
            answers = list(ex.map(lambda sid: api.post(f"/sandboxes/{sid}/snapshots", json={"name": "contested"}),
                                  (a, b)))
        assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
        snaps = [r.json() for r in answers]
        listed = {s["snapshotID"]: s for s in api.get("/snapshots").json()}
        assert {x["snapshotID"] for x in snaps} <= set(listed), "both snapshots exist"
        holders = [i for i, x in enumerate(snaps) if "contested" in listed[x["snapshotID"]]["names"]]
        assert len(holders) == 1, [listed[x["snapshotID"]]["names"] for x in snaps]
        (i,) = holders
        assert snaps[i]["createdAt"] >= snaps[1 - i]["createdAt"], "the name is on the newer snapshot"
        new = api.post("/sandboxes", json={"templateID": "contested"}).json()["sandboxID"]
        made.append(new)
        assert run(api, new, "cat /home/user/who.txt")["stdout"] == f"{(a, b)[i]}\n"
    finally:
        for sid in (a, b, *made):
            api.delete(f"/sandboxes/{sid}")
        for x in snaps:
            api.delete(f"/snapshots/{x['snapshotID']}")


def test_deleting_a_snapshot_keeps_layers_its_sandboxes_use(api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    run(api, sid, "echo layered > /home/user/l.txt")
    snap = api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
    api.delete(f"/sandboxes/{sid}")
    child = api.post("/sandboxes", json={"templateID": snap}).json()["sandboxID"]
    try:
        assert api.delete(f"/snapshots/{snap}").status_code == 204
        # The child's disk chain still reads the deleted snapshot's sealed layer.
        assert run(api, child, "sync; echo 3 > /proc/sys/vm/drop_caches; cat /home/user/l.txt",
                   user="root")["stdout"] == "layered\n"
        assert api.post(f"/sandboxes/{child}/pause").status_code == 204
        assert api.post(f"/sandboxes/{child}/resume").status_code == 201
        assert run(api, child, "cat /home/user/l.txt")["stdout"] == "layered\n"
    finally:
        api.delete(f"/sandboxes/{child}")


def test_corrupt_or_missing_layer_is_refused_and_leaves_nothing(api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    run(api, sid, "head -c 1048576 /dev/urandom > /dev/shm/x")
    snap = api.post(f"/sandboxes/{sid}/snapshots", json={"name": "to-corrupt"}).json()["snapshotID"]
    api.delete(f"/sandboxes/{sid}")
    repo = server.data_dir / "repository"
    manifest = (repo / "manifests" / f"{snap}.json").read_text()
    import json

    cp = json.loads(manifest)
    mem = repo / "layers" / cp["memory"][-1]["name"]
    data = bytearray(mem.read_bytes())
    data[8192] ^= 0xFF
    mem.chmod(0o644)
    mem.write_bytes(bytes(data))
    before = (host.sandbox_dirs(server.data_dir), host.qemu_pids(str(server.data_dir)))
    r = api.post("/sandboxes", json={"templateID": "to-corrupt"})
    assert r.status_code == 422, r.text
    assert "checksum" in r.json()["message"]
    data[8192] ^= 0xFF
    mem.write_bytes(bytes(data))
    # The device state is checked whole: also its first page (it was not, before).
    dev = repo / "layers" / cp["device"]["name"]
    state_bytes = bytearray(dev.read_bytes())
    state_bytes[100] ^= 0xFF
    dev.chmod(0o644)
    dev.write_bytes(bytes(state_bytes))
    r = api.post("/sandboxes", json={"templateID": "to-corrupt"})
    assert r.status_code == 422 and "checksum" in r.json()["message"], r.text
    state_bytes[100] ^= 0xFF
    dev.write_bytes(bytes(state_bytes))
    data[8192] ^= 0xFF  # the memory layer corrupt again, for the next step
    mem.write_bytes(bytes(data))
    disk = repo / "layers" / cp["disk"][-1]["name"]
    disk.unlink()
    data[8192] ^= 0xFF
    mem.write_bytes(bytes(data))
    r = api.post("/sandboxes", json={"templateID": "to-corrupt"})
    assert r.status_code == 422 and "missing" in r.json()["message"], r.text
    assert (host.sandbox_dirs(server.data_dir), host.qemu_pids(str(server.data_dir))) == before
    # A manifest cut short (a host crash on a filesystem without ordered writes) is refused,
    # stops the repository's gc, and is deleted by its id, which lets the gc go on.
    (repo / "manifests" / f"{snap}.json").write_text(manifest[: len(manifest) // 2])
    r = api.post("/sandboxes", json={"templateID": snap})
    assert r.status_code == 422 and "unreadable manifest" in r.json()["message"], r.text
    assert api.delete(f"/snapshots/{snap}").status_code == 204
    assert not (repo / "manifests" / f"{snap}.json").exists()
    assert api.post("/sandboxes", json={"templateID": snap}).status_code == 404
    deadline = time.monotonic() + 5
    while mem.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not mem.exists(), "the gc must collect the deleted snapshot's layers"


def test_auto_pause_at_timeout_then_connect_resumes(api: httpx.Client) -> None:
    # 6 s: the exec below must land before the timeout, also on a loaded 2-core host
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 6, "autoPause": True}).json()["sandboxID"]
    try:
        run(api, sid, "echo kept > /tmp/auto")
        deadline = time.monotonic() + 30
        while state(api, sid) != "paused" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state(api, sid) == "paused"
        r = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300})
        assert r.status_code == 201, r.text
        assert run(api, sid, "cat /tmp/auto")["stdout"] == "kept\n"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_repository_is_empty_once_everything_is_deleted(api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    snap = api.post(f"/sandboxes/{sid}/snapshots", json={}).json()["snapshotID"]
    kids = [x["sandbox"]["sandboxID"] for x in api.post(f"/sandboxes/{sid}/fork", json={"count": 2}).json()]
    api.post(f"/sandboxes/{kids[0]}/pause")
    for s in [sid, *kids]:
        api.delete(f"/sandboxes/{s}")
    api.delete(f"/snapshots/{snap}")
    layers = server.data_dir / "repository" / "layers"
    manifests = server.data_dir / "repository" / "manifests"
    assert list(manifests.iterdir()) == []
    if not all_sandboxes(api):  # nothing else on the node pins a layer
        deadline = time.monotonic() + 5
        while list(layers.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.name for p in layers.iterdir()] == []
        from agentenv.config import Settings

        mem_dir = Settings(data_dir=server.data_dir).mem_dir
        assert list(mem_dir.glob("fork-*.mem")) == [], "a fork's memory file outlived its children"


def test_a_forks_memory_file_is_freed_while_another_fork_is_in_progress(api: httpx.Client,
                                                                        server: ServerProcess) -> None:
    """Trainers fork all the time: a fork's memory file (tmpfs, the whole RAM of the VM) goes
    once its children are gone, even while another fork is in progress, and that other fork's
    file stays while its children start. Before, no fork file was freed while any fork ran."""
    from agentenv.config import Settings

    mem_dir = Settings(data_dir=server.data_dir).mem_dir
    a = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    b = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    a_kids = [x["sandbox"]["sandboxID"] for x in api.post(f"/sandboxes/{a}/fork", json={"count": 2}).json()]
    (a_file,) = list(mem_dir.glob("fork-*.mem"))
    stopped: list[int] = []
    try:
        with ThreadPoolExecutor(1) as threads:
            pending = threads.submit(lambda: server.client().post(f"/sandboxes/{b}/fork", json={"count": 2}))
            deadline = time.monotonic() + 30
            b_file = None
            while time.monotonic() < deadline and len(stopped) < 2:  # hold B's children where they restore
                b_file = next((f for f in mem_dir.glob("fork-*.mem") if f != a_file), None)
                if b_file is not None:
                    for pid in host.qemu_pids(str(b_file)):
                        if pid not in stopped:
                            os.kill(pid, signal.SIGSTOP)
                            stopped.append(pid)
                time.sleep(0.01)
            assert b_file is not None and len(stopped) == 2 and not pending.done()
            for k in a_kids:
                assert api.delete(f"/sandboxes/{k}").status_code == 204
            deadline = time.monotonic() + 10
            while a_file.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not a_file.exists(), "the first fork's file outlived its children"
            assert b_file.exists(), "the fork in progress lost its memory file"
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            stopped.clear()
            r = pending.result()
        assert r.status_code == 201, r.text
        b_kids = [x["sandbox"]["sandboxID"] for x in r.json()]
        for k in b_kids:
            assert run(api, k, "echo ok")["stdout"] == "ok\n"
            api.delete(f"/sandboxes/{k}")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        api.delete(f"/sandboxes/{a}")
        api.delete(f"/sandboxes/{b}")


def test_a_snapshot_deleted_while_a_sandbox_starts_from_it_leaves_that_sandbox_whole(
        api: httpx.Client, busy: tuple[str, str, str]) -> None:
    """The files of a saved state stay while a sandbox is being started from it, even if the
    snapshot is deleted meanwhile; the new sandbox's record pins them after that."""
    sid, _pid, md5 = busy
    r = api.post(f"/sandboxes/{sid}/snapshots", json={})
    assert r.status_code == 201, r.text
    snap = r.json()["snapshotID"]
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(lambda: api.post("/sandboxes", json={"templateID": snap, "timeout": 600}))
        time.sleep(0.05)
        assert api.delete(f"/snapshots/{snap}").status_code == 204
        child = pending.result()
    assert child.status_code == 201, child.text
    cid = child.json()["sandboxID"]
    try:
        assert run(api, cid, "md5sum < /dev/shm/blob")["stdout"].split()[0] == md5
        assert api.post(f"/sandboxes/{cid}/pause").status_code == 204
        assert api.post(f"/sandboxes/{cid}/resume", json={"timeout": 600}).status_code == 201
        assert run(api, cid, "cat /home/user/kept.txt")["stdout"] == "on-disk\n"
    finally:
        api.delete(f"/sandboxes/{cid}")
