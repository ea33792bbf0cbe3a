"""Admission of new VMs (``Orchestrator.admit``/``admitted``) by count and by host memory, with
the orchestrator's own methods on a stand-in: no VMs, MemAvailable from a file the test
writes, parked VMs and pool shells whose freeing gives memory back. The real parts are in
tests/e2e/test_memory_admission.py; these interleavings cannot be timed there."""

from __future__ import annotations

import asyncio
import time
import types
from pathlib import Path

import pytest

from agentenv.errors import CapacityExhausted
from agentenv.orchestrator import capacity
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox, Parked
from agentenv.orchestrator.service import Orchestrator
from agentenv.orchestrator.store import SandboxRecord

RESERVE = 1024


class Host:
    """MemAvailable as the test sets it."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, avail_mb: int) -> None:
        self.file = tmp_path / "meminfo"
        monkeypatch.setattr(capacity, "MEMINFO", self.file)
        self.set(avail_mb)

    def set(self, avail_mb: int) -> None:
        self.avail = avail_mb
        self.file.write_text(f"MemAvailable: {avail_mb * 1024} kB\n")


class Pool:
    """Ready shells, each of which gives ``mb`` back when destroyed."""

    def __init__(self, host: Host, shells: int, mb: int = 58) -> None:
        self.host, self.shells, self.mb = host, shells, mb

    async def give_back(self, _why: str) -> bool:
        if not self.shells:
            return False
        self.shells -= 1
        self.host.set(self.host.avail + self.mb)
        return True


class SnapshotShells(Pool):
    """Primed sandboxes of hot snapshots (orchestrator/snapshot_shells.py), given back after
    the warm pool's."""

    async def give_back(self) -> bool:  # type: ignore[override]
        return await super().give_back("")


class Slots:
    async def release(self, _slot: object) -> None:
        await asyncio.sleep(0.05)  # a namespace's teardown


def _record(i: int, state: State) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(id=f"s{i}", template="base", state=state, vcpus=1, memory_mb=512, disk_mb=1024,
                         started_at=now, end_at=now + 600, access_token="t", run_dir="/nonexistent")


def _orch(max_sandboxes: int, pool: Pool, snapshot_shells: SnapshotShells | None = None) -> types.SimpleNamespace:
    orch = types.SimpleNamespace(settings=types.SimpleNamespace(mem_reserve_mb=RESERVE, max_sandboxes=max_sandboxes),
                                 _live={}, _admitting=0, _admitting_mb=0, _admitted_ids=set(), _starting=[], slots=Slots(), pool=pool,
                                 snapshot_shells=snapshot_shells or SnapshotShells(pool.host, shells=0))
    for name in ("admit", "admitted", "check_count", "_active", "pinning", "counting", "memory_for"):
        setattr(orch, name, types.MethodType(getattr(Orchestrator, name), orch))
    return orch


def test_ready_pool_shells_are_given_back_for_a_create_instead_of_a_429(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool refilled into the headroom creates are admitted into; a create was refused
    while a dozen idle shells held the memory."""
    host = Host(tmp_path, monkeypatch, RESERVE + 40)
    pool = Pool(host, shells=12)
    orch = _orch(64, pool)
    asyncio.run(orch.admit())
    assert pool.shells == 11
    pool.shells = 0
    orch.snapshot_shells.shells = 1  # then a hot snapshot's primed sandbox
    host.set(RESERVE + 40)
    asyncio.run(orch.admit())
    assert orch.snapshot_shells.shells == 0
    host.set(RESERVE + 40)
    with pytest.raises(CapacityExhausted):  # nothing left to give back: the 429 stands
        asyncio.run(orch.admit())


def test_resumes_at_once_are_admitted_against_their_layers_not_the_same_free_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(tmp_path, monkeypatch, RESERVE + 700)
    orch = _orch(64, Pool(host, shells=0))
    admitted, refused = [], []

    async def resume(i: int) -> None:
        try:
            async with orch.admitted(extra_mb=300):  # a resume writing 300 MiB of layers
                admitted.append(i)
                await asyncio.sleep(0.1)  # its restore: the memory is taken only at the end
        except CapacityExhausted:
            refused.append(i)

    async def main() -> None:
        await asyncio.gather(*(resume(i) for i in range(8)))

    asyncio.run(main())
    assert (len(admitted), len(refused)) == (1, 7)  # 2 x (64 + 300) > 700
    assert (orch._admitting, orch._admitting_mb) == (0, 0)


def test_creates_that_arrive_during_an_eviction_do_not_push_the_node_past_its_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(tmp_path, monkeypatch, RESERVE + 63)  # one sandbox fits once the parked VM goes

    class Machine:
        async def kill(self) -> None:
            host.set(host.avail + 500)

    orch = _orch(3, Pool(host, shells=0))
    orch._live["s0"] = LiveSandbox(_record(0, State.RUNNING))
    parked = LiveSandbox(_record(1, State.PAUSED))
    parked.parked = Parked(Machine(), None, object(), since=0.0)  # type: ignore[arg-type]
    orch._live["s1"] = parked
    peak = 0

    async def create(delay: float) -> None:
        nonlocal peak
        await asyncio.sleep(delay)
        try:
            async with orch.admitted():
                peak = max(peak, orch._active())
                await asyncio.sleep(0.3)
        except CapacityExhausted:
            pass

    async def main() -> None:
        await asyncio.gather(create(0), create(0.02), create(0.03))

    asyncio.run(main())
    assert peak <= 3
