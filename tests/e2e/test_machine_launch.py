"""Launching QEMU itself, without a server: QEMU's own words when it cannot start, nothing
left behind either way."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.bench.node import CACHE, qemu_gone
from agentenv.images.artifacts import artifacts_present
from agentenv.storage import create_overlay
from agentenv.vmm import (
    Machine,
    MachineSpec,
    VmLaunchFailed,
    detect_accel,
    find_qemu_pids,
)


@pytest.fixture
def ram(tmp_path: Path) -> Iterator[Path]:
    path = Path("/dev/shm") / f"aenv-launch-test-{os.getpid()}-{tmp_path.name}.mem"
    yield path
    path.unlink(missing_ok=True)


def _spec(tmp_path: Path, disk: Path, ram: Path) -> MachineSpec:
    arts = artifacts_present(CACHE)
    assert arts is not None, f"no provisioned images in {CACHE}; run `aenv setup`"
    return MachineSpec(name="launch-test", run_dir=tmp_path / "run", sock_dir=tmp_path / "sock",
                       kernel=arts.kernel, initramfs=arts.initramfs, disk=disk, tools=arts.tools,
                       mem_path=ram, memory_mb=256, vcpus=1, accel=detect_accel("tcg"), mem_share=True, tap=None)


async def test_a_qemu_that_cannot_start_reports_its_own_error(tmp_path: Path, ram: Path) -> None:
    with pytest.raises(VmLaunchFailed) as err:
        await Machine.launch(_spec(tmp_path, tmp_path / "no-such-disk.qcow2", ram))
    assert "no-such-disk.qcow2" in str(err.value) and "No such file" in str(err.value)
    assert find_qemu_pids(str(tmp_path)) == {}


async def test_launch_returns_once_qemu_runs_and_kill_leaves_nothing(tmp_path: Path, ram: Path) -> None:
    arts = artifacts_present(CACHE)
    assert arts is not None
    disk = await create_overlay(tmp_path / "disk.qcow2", arts.rootfs, "raw")
    machine = await Machine.launch(_spec(tmp_path, disk, ram))
    try:
        assert find_qemu_pids(str(tmp_path)) == {machine.pid: "launch-test"}
        assert (await machine.qmp("query-status"))["status"] == "running"
    finally:
        await machine.kill()
    assert find_qemu_pids(str(tmp_path)) == {}


async def test_a_failure_after_qemu_started_kills_it(tmp_path: Path, ram: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever fails between QEMU's start and a connected Machine (here: the step that ranks
    a VM made ahead of time, made to raise) leaves no QEMU running. Before, an error there
    left the process behind with nobody holding it, one per warm-pool refill."""
    arts = artifacts_present(CACHE)
    assert arts is not None
    disk = await create_overlay(tmp_path / "disk.qcow2", arts.rootfs, "raw")

    def broken(pid: int, steps: int) -> bool:
        raise RuntimeError("injected")

    monkeypatch.setattr("agentenv.vmm.machine.priority.lower", broken)
    with pytest.raises(RuntimeError, match="injected"):
        await Machine.launch(_spec(tmp_path, disk, ram), nice=10)
    # SIGKILLed by the launch; a daemonized QEMU is not our child, so it is gone a moment later
    # (on a loaded CI host, not always by the time the launch has raised).
    assert qemu_gone(str(tmp_path), timeout=5)
