"""The keeper of primed sandboxes of hot snapshots (orchestrator/snapshot_shells.py), on a
stand-in orchestrator with stand-in shells (named as such: no VMs; making a real shell is a
restore, tests/e2e/test_snapshot_shells.py covers that). What these check are the keeper's
decisions, whose timing real VMs cannot pin down: a failed make, a hung one, the cap on hot
snapshots, and memory."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Iterator

import pytest

from agentenv.orchestrator import snapshot_shells as ss
from agentenv.storage import Checkpoint, LayerRef


def _cp(cp_id: str) -> Checkpoint:
    return Checkpoint(id=cp_id, kind="snapshot", template="t", base="/b", base_created_at=0, vcpus=1,
                      memory_mb=64, disk_mb=64, memory=(LayerRef("mem-x", 200 << 20, ""),), device=None,
                      disk=(), name=None)


class StandInOrch:
    def __init__(self) -> None:
        self.settings = types.SimpleNamespace(mem_reserve_mb=0, restore_timeout_s=0.1)
        self.repo = types.SimpleNamespace(exists=lambda _id: True)
        self.short = False
        self.counted: list[int] = []

    def memory_for(self, more: int = 1, extra_mb: int = 0) -> str | None:
        return "short" if self.short else None

    @contextlib.contextmanager
    def counting(self, more: int = 1, extra_mb: int = 0) -> Iterator[None]:
        self.counted.append(extra_mb)
        yield


class StandInShell:
    def __init__(self, cp_id: str) -> None:
        self.cp_id = cp_id
        self.started = types.SimpleNamespace(machine=types.SimpleNamespace(exited=False))


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> tuple[ss.SnapshotShells, StandInOrch, dict[str, object]]:
    orch = StandInOrch()
    shells = ss.SnapshotShells(orch, size=2, idle_s=300)  # type: ignore[arg-type]
    behaviour: dict[str, object] = {"fail": set(), "hang": set(), "destroyed": []}

    async def make(cp: Checkpoint) -> StandInShell:
        if cp.id in behaviour["fail"]:  # type: ignore[operator]
            raise RuntimeError("priming failed")
        if cp.id in behaviour["hang"]:  # type: ignore[operator]
            await asyncio.sleep(3600)
        return StandInShell(cp.id)

    async def destroy(shell: StandInShell) -> None:
        behaviour["destroyed"].append(shell.cp_id)  # type: ignore[attr-defined]

    monkeypatch.setattr(shells, "_make", make)
    monkeypatch.setattr(shells, "_destroy", destroy)
    return shells, orch, behaviour


async def _pass(shells: ss.SnapshotShells) -> None:
    """One pass of the keeper, as its loop runs it."""
    await shells._cool()
    for cp_id in list(shells._hot):
        await shells._fill(cp_id)


def test_a_failed_make_leaves_no_shell_of_the_snapshot_and_no_retry_for_a_while(pool) -> None:  # noqa: ANN001
    shells, _orch, behaviour = pool

    async def main() -> None:
        a = _cp("a")
        assert shells.take(a) is None
        shells.size = 1
        await _pass(shells)
        assert shells.fill_level() == (1, 1)
        shells.size = 2
        behaviour["fail"] = {"a"}
        await _pass(shells)  # the second fails: the first goes too (it was left unwatched before)
        await shells._destroyed()
        assert shells.fill_level() == (0, 0) and behaviour["destroyed"] == ["a"] and not shells._shells
        behaviour["fail"] = set()
        assert shells.take(a) is None
        assert shells.fill_level() == (0, 0), "not hot again within RETRY_AFTER_S"
        shells._failed["a"] -= ss.RETRY_AFTER_S
        shells.take(a)
        await _pass(shells)
        assert shells.fill_level() == (2, 2)

    asyncio.run(main())


def test_a_hung_make_is_given_up_and_other_snapshots_get_their_shells(pool, monkeypatch) -> None:  # noqa: ANN001
    """A priming that never ends (a login profile waiting on the network, say) held up every
    other snapshot's shells and their cooling, for good."""
    shells, orch, behaviour = pool
    behaviour["hang"] = {"a"}
    orch.settings.restore_timeout_s = 0.0
    monkeypatch.setattr(ss, "MAKE_MARGIN_S", 0.2)

    async def main() -> None:
        shells.take(_cp("a"))
        shells.take(_cp("b"))
        await asyncio.wait_for(_pass(shells), 5)
        assert shells.fill_level() == (2, 2)
        assert "a" not in shells._hot and len(shells._shells["b"]) == 2

    asyncio.run(main())


def test_at_most_max_hot_snapshots_keep_shells(pool) -> None:  # noqa: ANN001
    shells, _orch, behaviour = pool

    async def main() -> None:
        for i in range(ss.MAX_HOT):
            shells.take(_cp(f"s{i}"))
        shells.take(_cp("s0"))  # used again: now the most recent
        shells.take(_cp("new"))
        await _pass(shells)
        await shells._destroyed()
        assert set(shells._hot) == {f"s{i}" for i in range(ss.MAX_HOT) if i != 1} | {"new"}
        assert shells.fill_level() == (2 * ss.MAX_HOT, 2 * ss.MAX_HOT)

    asyncio.run(main())


def test_no_shell_is_made_while_the_host_is_short_and_each_is_counted_at_its_layers(pool) -> None:  # noqa: ANN001
    shells, orch, _behaviour = pool

    async def main() -> None:
        orch.short = True
        shells.take(_cp("a"))
        await _pass(shells)
        assert shells.fill_level() == (0, 2) and orch.counted == []
        orch.short = False
        await _pass(shells)
        assert shells.fill_level() == (2, 2) and orch.counted == [200, 200]

    asyncio.run(main())


def test_a_burst_of_starts_grows_the_snapshots_shells_to_its_size_up_to_the_maximum(pool) -> None:  # noqa: ANN001
    """A GRPO group resets together: the snapshot keeps as many shells as the most starts
    ever under way from it at once, so the next group finds them ready; resets one after
    another are no burst."""
    shells, _orch, _behaviour = pool
    shells.max_size = 5

    async def main() -> None:
        a, b, c = _cp("a"), _cp("b"), _cp("c")
        with contextlib.ExitStack() as group:  # a group of 4 under way at once
            for _ in range(4):
                group.enter_context(shells.starting(a))
        for _ in range(6):  # one reset after another
            with shells.starting(b):
                pass
        with contextlib.ExitStack() as group:  # a group larger than the maximum
            for _ in range(9):
                group.enter_context(shells.starting(c))
        await _pass(shells)
        assert {k: len(v) for k, v in shells._shells.items()} == {"a": 4, "b": 2, "c": 5}
        assert shells.fill_level() == (11, 11)
        with contextlib.ExitStack() as group:  # the next group of a: every start has a ready shell
            assert all(group.enter_context(shells.starting(a)) is not None for _ in range(4))
        await _pass(shells)
        assert len(shells._shells["a"]) == 4, "refilled to the group's size"
        await shells.forget("a")  # cold (or deleted): its bursts are forgotten too
        with shells.starting(a):
            pass
        await _pass(shells)
        assert len(shells._shells["a"]) == 2

    asyncio.run(main())
