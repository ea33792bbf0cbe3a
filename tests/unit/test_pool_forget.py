"""The warm pool's keeper when a template is forgotten (deleted) while it fills another: no
shell is kept for the forgotten one. Pure asyncio: the shells are stand-ins made by the
factory the pool is given (the real ones restore a VM: tests/e2e/test_faults.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

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
