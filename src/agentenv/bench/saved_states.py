"""Benchmark scenarios of issue #3: pause, resume, snapshot, fork, reset, and the baseline of
what plain QEMU would do (full-RAM ``migrate`` to a file and back) measured in the same run.

Every figure is "API call → done" as a user sees it: pause until the 204, resume until the
201 (the guest agent has answered its clock/entropy update), fork until every child has
answered a command.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.bench.node import LocalNode, pss_kb, qemu_pids, scratch_host
from agentenv.bench.stats import wait_pool
from agentenv.envd_client import EnvdClient
from agentenv.orchestrator.templates import guest_link_spec
from agentenv.storage import TemplateSnapshot, create_overlay, remove_tree
from agentenv.vmm import Machine, MachineSpec, detect_accel

MIGRATE_CIDR = "10.217.17.0/24"


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _create(api: httpx.Client, template: str = "base") -> str:
    r = api.post("/sandboxes", json={"templateID": template, "timeout": 900})
    r.raise_for_status()
    return str(r.json()["sandboxID"])


def _run(api: httpx.Client, sid: str, cmd: str) -> str:
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 600})
    r.raise_for_status()
    out = r.json()
    if out["exitCode"] != 0:
        raise RuntimeError(f"{cmd!r} failed in {sid}: {out['stderr']}")
    return str(out["stdout"])


def _dirty(mib: int) -> str:
    """Guest command that dirties ``mib`` MiB of guest RAM (a tmpfs file of random bytes)."""
    return f"head -c {mib << 20} /dev/urandom > /dev/shm/dirty-$RANDOM"


# The bench node parks a paused sandbox's stopped VM for this long (AENV_PAUSE_LINGER_S; the
# default is 60 s), so that one run measures both resumes: within the linger and after it.
PAUSE_LINGER_S = 4.0


def bench_pause_resume(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """A fresh sandbox dirties N MiB, then pause (→ 204) and resume (→ 201), per size. The
    resume right after the pause continues the parked VM (``resume_*``); in some runs the
    sandbox is then paused again and resumed once its VM was freed (``resume_cold_*``: a new
    QEMU restored from the saved state, the same state as far as memory goes)."""
    out: dict[str, list[float]] = {}
    for mib in (20, 200):
        pauses, resumes, colds = [], [], []
        for i in range(runs):
            sid = _create(api)
            try:
                _run(api, sid, _dirty(mib))
                wait_pool(node)  # no warm-pool refill competing for the CPU while measuring
                pids = qemu_pids(sid)
                t0 = time.perf_counter()
                api.post(f"/sandboxes/{sid}/pause").raise_for_status()
                pauses.append(_ms(t0))
                wait_pool(node)
                t0 = time.perf_counter()
                api.post(f"/sandboxes/{sid}/resume", json={"timeout": 900}).raise_for_status()
                resumes.append(_ms(t0))
                if qemu_pids(sid) != pids:
                    raise RuntimeError(f"{sid} was not resumed on its parked VM")
                if i < max(1, min(runs, 5)):
                    api.post(f"/sandboxes/{sid}/pause").raise_for_status()
                    time.sleep(PAUSE_LINGER_S + 1.0)
                    if qemu_pids(sid):
                        raise RuntimeError(f"the parked VM of {sid} outlived its linger time")
                    wait_pool(node)
                    t0 = time.perf_counter()
                    api.post(f"/sandboxes/{sid}/resume", json={"timeout": 900}).raise_for_status()
                    colds.append(_ms(t0))
            finally:
                api.delete(f"/sandboxes/{sid}")
        out[f"pause_{mib}mib_ms"] = pauses
        out[f"resume_{mib}mib_ms"] = resumes
        out[f"resume_cold_{mib}mib_ms"] = colds
    return out


def _timed_snapshot(api: httpx.Client, sid: str) -> float:
    """``POST /snapshots`` → 201, in ms; the snapshot is deleted again (untimed)."""
    t0 = time.perf_counter()
    r = api.post(f"/sandboxes/{sid}/snapshots", json={})
    r.raise_for_status()
    dt = _ms(t0)
    api.delete(f"/snapshots/{r.json()['snapshotID']}")
    return dt


def bench_snapshot_disk(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """Named snapshot right after the guest wrote 1 GiB to its disk (O_DIRECT, so the data is
    on the disk, not in guest RAM), against a snapshot with nothing written."""
    out: dict[str, list[float]] = {"snapshot_1gib_disk_ms": [], "snapshot_idle_ms": []}
    sid = _create(api)
    try:
        for i in range(max(1, min(runs, 3))):
            out["snapshot_idle_ms"].append(_timed_snapshot(api, sid))
            _run(api, sid, f"dd if=/dev/zero of=/home/user/big{i} bs=4M count=256 oflag=direct 2>/dev/null")
            wait_pool(node)
            out["snapshot_1gib_disk_ms"].append(_timed_snapshot(api, sid))
            _run(api, sid, f"rm -f /home/user/big{i}")
    finally:
        api.delete(f"/sandboxes/{sid}")
    return out


def bench_fork(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """Fork 16 (API call → every child answered a command), the children's PSS, and the GRPO
    reset (kill a child, start a fresh one from the same snapshot), against the baseline of
    a reset from a snapshot nothing was started from yet (no primed shell of it ready:
    orchestrator/snapshot_shells.py)."""
    out: dict[str, list[float]] = {"fork16_ms": [], "fork_child_pss_mb": [], "reset_ms": [], "reset_cold_ms": []}
    for _ in range(max(1, min(runs, 3))):
        src = _create(api)
        kids: list[str] = []
        try:
            _run(api, src, _dirty(20))
            wait_pool(node)
            t0 = time.perf_counter()
            r = api.post(f"/sandboxes/{src}/fork", json={"count": 16})
            r.raise_for_status()
            kids = [x["sandbox"]["sandboxID"] for x in r.json() if "sandbox" in x]
            with ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda k: _run(api, k, "true"), kids))
            if len(kids) == 16:
                out["fork16_ms"].append(_ms(t0))
            time.sleep(2)
            for k in kids:
                for pid in qemu_pids(k):
                    out["fork_child_pss_mb"].append(pss_kb(pid) / 1024)
        finally:
            for k in kids:
                api.delete(f"/sandboxes/{k}")
            api.delete(f"/sandboxes/{src}")
    # reset: a named snapshot is the episode's start; each reset kills the child and starts anew
    src = _create(api)
    try:
        _run(api, src, _dirty(20))
        snap = api.post(f"/sandboxes/{src}/snapshots", json={}).json()["snapshotID"]
        child = _create(api, snap)
        for _ in range(runs):
            child = _timed_reset(node, api, child, snap, out["reset_ms"])
        api.delete(f"/sandboxes/{child}")
        api.delete(f"/snapshots/{snap}")
        for _ in range(max(1, min(runs, 5))):
            # baseline: the same reset from a snapshot nothing was started from yet (no shell)
            cold = api.post(f"/sandboxes/{src}/snapshots", json={}).json()["snapshotID"]
            kid = _timed_reset(node, api, _create(api), cold, out["reset_cold_ms"])
            api.delete(f"/sandboxes/{kid}")
            api.delete(f"/snapshots/{cold}")
    finally:
        api.delete(f"/sandboxes/{src}")
    return out


GROUP = 8  # rollouts of a GRPO group reset together in bench_reset_group


def bench_reset_group(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """A GRPO group's reset: its ``GROUP`` rollouts killed and started again from the episode's
    snapshot at once, until every one has answered a command. Timed once the snapshot has kept
    a shell for each (it saw the group's first start: orchestrator/snapshot_shells.py), against
    the baseline of that first start of the group, which restored all but a few cold."""
    out: dict[str, list[float]] = {"reset_group8_ms": [], "reset_group8_first_ms": []}
    src = _create(api)
    try:
        _run(api, src, _dirty(20))
        for _ in range(max(1, min(runs, 3))):
            snap = api.post(f"/sandboxes/{src}/snapshots", json={}).json()["snapshotID"]
            kids = [_create(api, snap)]  # an episode began from it: hot, with its usual shells
            try:
                wait_pool(node)
                kids = _timed_group(api, kids, snap, out["reset_group8_first_ms"])
                wait_pool(node, timeout=300)  # a shell for each of the group
                kids = _timed_group(api, kids, snap, out["reset_group8_ms"])
            finally:
                for k in kids:
                    api.delete(f"/sandboxes/{k}")
                api.delete(f"/snapshots/{snap}")
    finally:
        api.delete(f"/sandboxes/{src}")
    return out


def _timed_group(api: httpx.Client, kids: list[str], snap: str, into: list[float]) -> list[str]:
    """Kill ``kids`` and start ``GROUP`` sandboxes from ``snap`` at once, each until it has
    answered a command; timed into ``into``. The new ids."""
    def reset(i: int) -> str:
        if i < len(kids):
            api.delete(f"/sandboxes/{kids[i]}").raise_for_status()
        kid = _create(api, snap)
        _run(api, kid, "true")
        return kid

    t0 = time.perf_counter()
    with ThreadPoolExecutor(GROUP) as ex:
        new = list(ex.map(reset, range(GROUP)))
    into.append(_ms(t0))
    return new


def _timed_reset(node: LocalNode, api: httpx.Client, kid: str, snap: str, into: list[float]) -> str:
    """Kill ``kid`` and start a new sandbox from ``snap``, timed into ``into``; the new id."""
    wait_pool(node)
    t0 = time.perf_counter()
    api.delete(f"/sandboxes/{kid}").raise_for_status()
    kid = _create(api, snap)
    into.append(_ms(t0))
    return kid


# -- baseline: plain QEMU migration of the whole RAM to a file and back --------------------------

async def _migrate_baseline(template_dir: Path, tmp: Path, runs: int, accel_setting: str) -> dict[str, list[float]]:
    snap = TemplateSnapshot.load(template_dir)
    assert snap is not None, f"no template snapshot in {template_dir}"
    accel = detect_accel(accel_setting)
    out: dict[str, list[float]] = {}
    async with scratch_host(tmp / "migrate", MIGRATE_CIDR) as (settings, slots):
        for mib in (20, 200):
            saves, loads = [], []
            for i in range(runs):
                d = tmp / f"mig{mib}-{i}"
                slot = await slots.acquire()
                await create_overlay(d / "disk.qcow2", snap.disk, "qcow2")
                def spec(name: str, run_dir: Path, mem_path: Path) -> MachineSpec:
                    return MachineSpec(name=name, run_dir=run_dir, sock_dir=settings.sock_dir, kernel=Path(snap.kernel),
                                       initramfs=Path(snap.initramfs), disk=d / "disk.qcow2", tools=Path(snap.tools),
                                       mem_path=mem_path, memory_mb=snap.memory_mb, vcpus=snap.vcpus, accel=accel,
                                       netns=slot.netns, incoming=True, tcg_cpu=snap.tcg_cpu,
                                       **guest_link_spec())

                src = await Machine.launch(spec(f"bench-mig-src{i}", d / "src", snap.mem_file))
                dst: Machine | None = None
                fresh = settings.mem_dir / f"mig{i}.mem"
                try:
                    await src.prepare_incoming()
                    await src.load_state(snap.state)
                    async with EnvdClient.for_guest(slot.guest_url) as envd:
                        await envd.wait_healthy(60)
                        await envd.run(["bash", "-c", _dirty(mib)], user="root", timeout=300)
                    # plain QEMU: stop, migrate everything (a share=off RAM block is never skipped)
                    await src.qmp("migrate-set-capabilities",
                                  capabilities=[{"capability": "x-ignore-shared", "state": False}])
                    t0 = time.perf_counter()
                    await src.qmp("stop")
                    await src.qmp("migrate", uri=f"exec:cat > {d / 'full.state'}")
                    await src._wait_migration(120)
                    saves.append(_ms(t0))
                    await src.kill()
                    t0 = time.perf_counter()
                    dst = await Machine.launch(spec(f"bench-mig-dst{i}", d / "dst", fresh))
                    await dst.load_state(d / "full.state", timeout=120)
                    async with EnvdClient.for_guest(slot.guest_url) as envd:
                        await envd.wait_healthy(60)
                    loads.append(_ms(t0))
                finally:
                    await src.kill()
                    if dst is not None:
                        await dst.kill()
                    fresh.unlink(missing_ok=True)
                    await slots.release(slot)
                    await remove_tree(d)
            out[f"migrate_save_{mib}mib_ms"] = saves
            out[f"migrate_load_{mib}mib_ms"] = loads
    return out


def bench_migrate_baseline(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    dirs = sorted((node.data_dir / "templates" / "base" / "snapshots").glob("*/meta.json"))
    assert dirs, "the bench node has no template snapshot yet"
    return asyncio.run(_migrate_baseline(dirs[0].parent, node.data_dir.parent / "migrate-baseline",
                                         max(1, min(runs, 5)), node.env.get("AENV_ACCEL", "auto")))
