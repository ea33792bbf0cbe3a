"""Primed sandboxes of hot snapshots (orchestrator/snapshot_shells.py): the GRPO reset.

Once a sandbox has been started from a named snapshot, the node starts a few more from it
ahead of time; the next create from the snapshot takes one. These tests run a node of their
own with such shells on (the other tests' nodes keep none)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import ns_addr, run
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess

IDLE_S = 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path_factory.mktemp("shells") / "data", node_cidr(44), AENV_POOL_SIZE="0",
                      AENV_SNAPSHOT_POOL_SIZE="1", AENV_SNAPSHOT_POOL_IDLE_S=str(IDLE_S))
    s.start()
    yield s
    s.kill_all()


def details(node: ServerProcess) -> dict:
    return node.details()


def wait_shells(node: ServerProcess, ready: int, wanted: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = details(node)
        if (d["snapshotShellsReady"], d["snapshotShellsWanted"]) == (ready, wanted):
            return
        time.sleep(0.2)
    raise AssertionError(f"snapshot shells: {details(node)}, expected {ready} ready of {wanted}")


def egress(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "chain", "ip", "aenv", "egress"],
                          capture_output=True, text=True).stdout


def test_a_reset_from_a_hot_snapshot_takes_a_primed_sandbox_of_its_own(node: ServerProcess) -> None:
    with node.client() as api:
        src = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
        run(api, src, "echo episode-start > /home/user/state.txt; head -c 1048576 /dev/urandom > /dev/shm/m")
        md5 = run(api, src, "md5sum < /dev/shm/m")["stdout"]
        snap = api.post(f"/sandboxes/{src}/snapshots", json={"name": "episode"}).json()["snapshotID"]
        api.delete(f"/sandboxes/{src}")
        wait_shells(node, 0, 0)  # nothing started from it yet: not hot
        first = api.post("/sandboxes", json={"templateID": "episode"}).json()["sandboxID"]
        wait_shells(node, 1, 1)
        before = set(host.qemu_pids(str(node.data_dir)))
        shell_pids = before - host.qemu_pids(first)
        # it waits behind live sandboxes (vmm/priority.py) ...
        assert shell_pids and all(host.cpu_nice(p) == {10} for p in shell_pids)
        r = api.post("/sandboxes", json={"templateID": "episode", "envVars": {"EPISODE": "7"}, "timeout": 120,
                                         "metadata": {"run": "r1"}, "network": {"denyOut": ["203.0.113.0/24"]}})
        assert r.status_code == 201, r.text
        second = r.json()["sandboxID"]
        pids = set(host.qemu_pids(second))
        assert pids and pids <= before, "not the primed sandbox that was ready"
        assert all(host.cpu_nice(p) == {0} for p in pids), "... and runs as they do once handed out"
        info = api.get(f"/sandboxes/{second}").json()
        assert info["metadata"] == {"run": "r1"} and info["templateID"] == "episode"
        # the snapshot's state, the create's env vars and network policy, an identity of its own
        out = run(api, second, "cat /home/user/state.txt; md5sum < /dev/shm/m; echo $EPISODE; "
                               "echo $E2B_SANDBOX_ID; date +%s; head -c 16 /dev/urandom | od -An -tx1")["stdout"]
        state_txt, m, episode, own_id, clock, noise = out.splitlines()
        assert (state_txt, m + "\n", episode, own_id) == ("episode-start", md5, "7", second)
        assert abs(int(clock) - time.time()) < 5, "the clock was set when it was handed out"
        other = run(api, first, "head -c 16 /dev/urandom | od -An -tx1")["stdout"].strip()
        assert noise.strip() != other
        ns, _ = ns_addr(node, second)
        assert "203.0.113.0/24" in egress(ns)
        assert api.post(f"/sandboxes/{second}/exec", json={"cmd": "true"}).status_code == 200
        wait_shells(node, 1, 1)  # made again in the background
        # deleting the snapshot destroys its shell with it, and leaves its sandboxes running
        shell_dirs = host.sandbox_dirs(node.data_dir) - {s["sandboxID"] for s in api.get("/sandboxes").json()}
        assert shell_dirs, "the ready shell has a run dir"
        assert api.delete(f"/snapshots/{snap}").status_code == 204
        wait_shells(node, 0, 0)
        left = host.sandbox_dirs(node.data_dir) - {s["sandboxID"] for s in api.get("/sandboxes").json()}
        assert not (left & shell_dirs), "the shell of a deleted snapshot is gone"
        assert all(host.qemu_gone(d) for d in shell_dirs)
        assert run(api, second, "cat /home/user/state.txt")["stdout"] == "episode-start\n"
        for sid in (first, second):
            api.delete(f"/sandboxes/{sid}")


def hot_snapshot(node: ServerProcess, api: httpx.Client) -> tuple[str, str, str, set[str]]:
    """A sandbox, a snapshot of it and a sandbox started from that, once the snapshot's shell
    is ready: (source, snapshot, started, the shell's run dir)."""
    src = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    snap = api.post(f"/sandboxes/{src}/snapshots", json={}).json()["snapshotID"]
    kid = api.post("/sandboxes", json={"templateID": snap}).json()["sandboxID"]
    wait_shells(node, 1, 1)
    shells = host.sandbox_dirs(node.data_dir) - {s["sandboxID"] for s in api.get("/sandboxes").json()}
    assert len(shells) == 1
    return src, snap, kid, shells


def test_a_snapshot_nothing_starts_from_cools_and_its_shells_go(node: ServerProcess) -> None:
    with node.client() as api:
        src, snap, kid, shells = hot_snapshot(node, api)
        wait_shells(node, 0, 0, timeout=IDLE_S + 30)
        deadline = time.monotonic() + 10  # (no longer counted from the moment it is cold)
        while host.sandbox_dirs(node.data_dir) & shells and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(host.qemu_gone(d) for d in shells)
        assert not (host.sandbox_dirs(node.data_dir) & shells)
        for sid in (src, kid):
            api.delete(f"/sandboxes/{sid}")
        api.delete(f"/snapshots/{snap}")


def test_a_shell_primed_under_a_name_that_moved_on_is_handed_out_under_its_id(node: ServerProcess) -> None:
    """A snapshot's name goes to the newest snapshot given it; a shell primed while the older
    one had it must not tell its guest that name."""
    with node.client() as api:
        src = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        older = api.post(f"/sandboxes/{src}/snapshots", json={"name": "moving"}).json()["snapshotID"]
        kid = api.post("/sandboxes", json={"templateID": "moving"}).json()["sandboxID"]
        assert run(api, kid, "echo $E2B_TEMPLATE_ID")["stdout"] == "moving\n"
        wait_shells(node, 1, 1)
        newer = api.post(f"/sandboxes/{src}/snapshots", json={"name": "moving"}).json()["snapshotID"]
        handed = api.post("/sandboxes", json={"templateID": older}).json()["sandboxID"]
        assert api.get(f"/sandboxes/{handed}").json()["templateID"] == older
        assert run(api, handed, "echo $E2B_TEMPLATE_ID")["stdout"] == older + "\n"
        for sid in (src, kid, handed):
            api.delete(f"/sandboxes/{sid}")
        for snap in (older, newer):
            api.delete(f"/snapshots/{snap}")
        wait_shells(node, 0, 0)


def test_shells_left_by_a_crashed_server_are_removed_at_its_next_start(node: ServerProcess) -> None:
    """They have no record: the next start's recovery kills their QEMUs, as the warm pool's."""
    with node.client() as api:
        src, snap, kid, shells = hot_snapshot(node, api)
    node.stop(9)
    node.start()
    with node.client() as api:
        assert {s["sandboxID"] for s in api.get("/sandboxes").json()} >= {src, kid}
        assert all(host.qemu_gone(d) for d in shells)
        assert not (host.sandbox_dirs(node.data_dir) & shells)
        assert run(api, kid, "echo ok")["stdout"] == "ok\n"
        for sid in (src, kid):
            api.delete(f"/sandboxes/{sid}")
        api.delete(f"/snapshots/{snap}")


def test_a_group_that_resets_together_finds_its_shells_ready_the_next_time(node: ServerProcess) -> None:
    """GRPO: the G rollouts of a group start from the episode's snapshot at once. The first
    group restores cold (the node keeps one shell per snapshot); the snapshot then keeps G,
    and every start of the next group takes one that is ready."""
    group = 3
    with node.client() as api:
        src = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        run(api, src, "echo episode-start > /home/user/state.txt")
        snap = api.post(f"/sandboxes/{src}/snapshots", json={}).json()["snapshotID"]
        api.delete(f"/sandboxes/{src}")

        def start(_: int) -> str:
            r = api.post("/sandboxes", json={"templateID": snap})
            assert r.status_code == 201, r.text
            return r.json()["sandboxID"]

        with ThreadPoolExecutor(group) as ex:
            first = list(ex.map(start, range(group)))
        wait_shells(node, group, group)
        ready = set(host.qemu_pids(str(node.data_dir))) - set().union(*(host.qemu_pids(s) for s in first))
        for sid in first:
            api.delete(f"/sandboxes/{sid}")
        with ThreadPoolExecutor(group) as ex:
            second = list(ex.map(start, range(group)))
        for sid in second:
            pids = set(host.qemu_pids(sid))
            assert pids and pids <= ready, "a start of the second group restored instead of taking a shell"
            assert run(api, sid, "cat /home/user/state.txt; echo $E2B_SANDBOX_ID")["stdout"] == f"episode-start\n{sid}\n"
        wait_shells(node, group, group)  # made again for the next group
        for sid in second:
            api.delete(f"/sandboxes/{sid}")
        assert api.delete(f"/snapshots/{snap}").status_code == 204
        wait_shells(node, 0, 0)
