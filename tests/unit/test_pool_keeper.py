"""The warm pool's keeper: when a template is forgotten (deleted) while it fills another, no
shell is kept for the forgotten one; a template whose refills fail is retried less and less
often, without holding up the others. Pure asyncio: the shells are stand-ins made by the
factory the pool is given (the real ones restore a VM: tests/e2e/test_faults.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentenv.orchestrator import pool as pool_module
from agentenv.orchestrator.pool import WarmPool
from agentenv.orchestrator.shells import Shell


class StandInSnapshot:
    def __init__(self, d: Path) -> None:
        self.dir, self.mem_file = d, d / "mem"
        d.mkdir(parents=True)
        self.mem_file.write_text("x")


class _Running:
    exited = False


class StandInShell(Shell):
    def __init__(self, snap: StandInSnapshot, destroyed: list[StandInShell]) -> None:  # no VM
        self.snapshot, self.machine, self._destroyed = snap, _Running(), destroyed  # type: ignore[assignment]

    async def destroy(self, _slots: object) -> None:
        self._destroyed.append(self)


def test_a_template_forgotten_during_a_fill_gets_no_shells(tmp_path: Path) -> None:
    async def main() -> None:
        a, b = StandInSnapshot(tmp_path / "a"), StandInSnapshot(tmp_path / "b")
        destroyed: list[StandInShell] = []

        async def factory(snap: StandInSnapshot) -> StandInShell:
            await asyncio.sleep(0.05 if snap is a else 0.001)  # a is slow: b is forgotten meanwhile
            return StandInShell(snap, destroyed)

        pool = WarmPool(4, factory, slots=None, check_interval_s=0.05)  # type: ignore[arg-type]
        pool.warm(a)  # type: ignore[arg-type]
        pool.warm(b)  # type: ignore[arg-type]
        pool.start()
        await asyncio.sleep(0.02)  # the keeper is filling a
        await pool.forget(b.dir)
        await asyncio.sleep(0.6)
        try:
            assert pool.fill_level() == (4, 4)
            assert not pool._shells.get(b.dir), "shells kept for a forgotten template"
            assert all(s.snapshot is a for s in destroyed)
        finally:
            await pool.stop()

    asyncio.run(main())


def test_failing_refills_back_off_and_do_not_hold_up_other_templates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a failed refill slept a second in the keeper (every other template waited) and
    tried again every second for as long as the fault lasted, leaving a log line each time."""
    monkeypatch.setattr(pool_module, "RETRY_S", 0.05)
    monkeypatch.setattr(pool_module, "MAX_RETRY_S", 0.2)

    async def main() -> None:
        broken, fine = StandInSnapshot(tmp_path / "broken"), StandInSnapshot(tmp_path / "fine")
        tries: list[float] = []
        heal_after = 7

        async def factory(snap: StandInSnapshot) -> StandInShell:
            if snap is broken:
                tries.append(asyncio.get_running_loop().time())
                if len(tries) < heal_after:
                    raise RuntimeError("injected: QEMU cannot start")
            return StandInShell(snap, [])

        pool = WarmPool(1, factory, slots=None, fill_concurrency=1, check_interval_s=5.0)  # type: ignore[arg-type]
        pool.warm(broken)  # type: ignore[arg-type]
        pool.warm(fine)  # type: ignore[arg-type]
        pool.start()
        try:
            await asyncio.sleep(0.1)
            assert pool._shells.get(fine.dir), "the fine template waited for the broken one"
            await asyncio.sleep(1.2)
            gaps = [b - a for a, b in zip(tries, tries[1:])]
            assert len(tries) == heal_after, tries  # healed: no try after the one that made a shell
            assert [round(g, 2) >= want for g, want in zip(gaps, (0.05, 0.1, 0.2, 0.2, 0.2, 0.2))] == [True] * 6, gaps
            assert gaps[2] < 0.4, gaps  # woken when a retry falls due, not at the 5 s interval
            assert pool.fill_level() == (2, 2)
            assert not pool._failures and not pool._retry_at
        finally:
            await pool.stop()

    asyncio.run(main())


class StuckShell(StandInShell):
    """A shell whose QEMU does not die: its destroy fails (as Machine.kill's VmmError)."""

    sandbox_id = "stuck"

    async def destroy(self, _slots: object) -> None:
        raise RuntimeError("injected: QEMU did not exit after SIGKILL")


def test_one_shell_that_cannot_be_destroyed_does_not_stop_the_others_or_the_keeper(tmp_path: Path) -> None:
    """Before, the first failed destroy ended `forget` (the shells after it kept running with
    nobody holding them) and, in a pass of the keeper, the keeper itself (no refill again)."""
    async def main() -> None:
        a = StandInSnapshot(tmp_path / "a")
        destroyed: list[StandInShell] = []
        made = 0
        shrink = True

        async def factory(snap: StandInSnapshot) -> StandInShell:
            nonlocal made
            made += 1
            return StuckShell(snap, destroyed) if made == 1 else StandInShell(snap, destroyed)

        pool = WarmPool(3, factory, slots=None, check_interval_s=0.05,  # type: ignore[arg-type]
                        must_shrink=lambda: shrink, may_grow=lambda: not shrink)
        pool._shells[a.dir] = [StandInShell(a, destroyed), StuckShell(a, destroyed), StandInShell(a, destroyed)]  # type: ignore[list-item]
        pool._hot[a.dir] = a  # type: ignore[assignment]
        pool.start()
        try:
            await asyncio.sleep(0.3)  # the keeper gives every shell back; one destroy fails
            assert len(destroyed) == 2 and not pool._shells[a.dir]
            shrink = False
            for _ in range(80):  # (a keeper that found the host short waits 5 s before it looks again)
                if pool.fill_level() == (3, 3):
                    break
                await asyncio.sleep(0.1)
            assert pool.fill_level() == (3, 3), "the keeper stopped after a failed destroy"
            destroyed.clear()
            await pool.forget(a.dir)
            assert len(destroyed) == 2, "a failed destroy kept the shells after it"
        finally:
            await pool.stop()

    asyncio.run(main())


def test_a_due_retry_of_a_template_without_its_memory_file_does_not_spin_the_keeper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_module, "RETRY_S", 0.05)

    async def main() -> None:
        a = StandInSnapshot(tmp_path / "a")

        async def factory(snap: StandInSnapshot) -> StandInShell:
            raise RuntimeError("injected")

        pool = WarmPool(1, factory, slots=None, check_interval_s=0.5)  # type: ignore[arg-type]
        passes = 0
        shrink = pool._shrink

        async def counted() -> bool:
            nonlocal passes
            passes += 1
            return await shrink()

        pool._shrink = counted  # type: ignore[method-assign]
        pool.warm(a)  # type: ignore[arg-type]
        pool.start()
        try:
            await asyncio.sleep(0.02)  # one refill failed: a retry is due in 0.05 s
            a.mem_file.unlink()  # (the snapshot was removed meanwhile)
            await asyncio.sleep(1.0)
            assert passes < 10, f"{passes} passes of the keeper in a second"
        finally:
            await pool.stop()

    asyncio.run(main())


def test_a_pool_stopped_while_it_makes_shells_destroys_those_made(tmp_path: Path) -> None:
    async def main() -> None:
        a = StandInSnapshot(tmp_path / "a")
        destroyed: list[StandInShell] = []
        calls = 0
        slow_cancelled = asyncio.Event()

        async def factory(snap: StandInSnapshot) -> StandInShell:
            nonlocal calls
            calls += 1
            if calls == 2:  # the second of the batch is still restoring when the pool stops
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    slow_cancelled.set()
                    raise
            return StandInShell(snap, destroyed)

        pool = WarmPool(2, factory, slots=None, fill_concurrency=2, check_interval_s=5.0)  # type: ignore[arg-type]
        pool.warm(a)  # type: ignore[arg-type]
        pool.start()
        await asyncio.sleep(0.1)
        await asyncio.wait_for(pool.stop(), 5)
        assert slow_cancelled.is_set()
        assert len(destroyed) == 1, "the shell made before the stop was left running"

    asyncio.run(main())
