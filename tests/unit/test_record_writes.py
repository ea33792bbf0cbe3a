"""How the orchestrator writes a sandbox's record (Orchestrator._save): writers that hold no
lock of the sandbox (set_timeout, refresh) and operations that do (a network update, a
snapshot) each change their own fields, and a write cut short by the server's stop leaves
the record in memory as the store got it. The store is a slow stand-in here, so that the
interleavings the server meets under load happen every time."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest

from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.orchestrator.service import Orchestrator
from agentenv.orchestrator.store import SandboxRecord


class SlowStore:
    """Stands in for SQLite: each put takes ``delay`` seconds in a thread, as a loaded disk's."""

    def __init__(self, delay: float) -> None:
        self.delay, self.rows, self._lock = delay, [], threading.Lock()

    async def put(self, r: SandboxRecord) -> None:
        def write() -> None:
            threading.Event().wait(self.delay)
            with self._lock:
                self.rows.append(r)

        await asyncio.to_thread(write)


def _live() -> LiveSandbox:
    rec = SandboxRecord(id="iabc", template="base", state=State.RUNNING, vcpus=1, memory_mb=512, disk_mb=4096,
                        started_at=0.0, end_at=100.0, access_token="t", run_dir="/nonexistent",
                        options={"network": {"allowOut": [], "denyOut": []}})
    return LiveSandbox(rec)


async def test_a_timeout_set_during_an_operations_write_is_kept() -> None:
    orch = types.SimpleNamespace(store=SlowStore(0.2))
    live = _live()

    async def update_network() -> None:
        def deny(r: SandboxRecord) -> SandboxRecord:
            return r.with_(options={**r.options, "network": {"allowOut": [], "denyOut": ["1.2.3.4/32"]}})
        await Orchestrator._save(orch, live, deny)  # type: ignore[arg-type]

    async def set_timeout() -> None:
        await asyncio.sleep(0.05)  # while the update's write is under way
        await Orchestrator._save(orch, live, end_at=900.0, timeout_s=900)  # type: ignore[arg-type]

    await asyncio.gather(update_network(), set_timeout())
    for rec in (live.record, orch.store.rows[-1]):  # in memory, and what the store holds last
        assert rec.end_at == 900.0 and rec.options["network"]["denyOut"] == ["1.2.3.4/32"]


async def test_a_write_cut_short_by_the_stop_leaves_memory_as_the_store_has_it() -> None:
    orch = types.SimpleNamespace(store=SlowStore(0.2))
    live = _live()
    write = asyncio.ensure_future(Orchestrator._save(orch, live, state=State.RESUMING, slot_index=3))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    assert orch.store.rows[-1].state == State.RESUMING
    assert live.record.state == State.RESUMING and live.record.slot_index == 3
