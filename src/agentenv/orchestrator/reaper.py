"""The timeout reaper: running sandboxes whose ``end_at`` passed are killed, or paused when
they were created with auto-pause (E2B's semantics; ``autoPauseMemory: false`` makes that
pause filesystem-only). Failed sandboxes are killed at theirs, which the failure pushed out by
AENV_ERROR_KEEP_S so that the reason can still be read (``LiveSandbox.past_end``).

A few at a time, each in its own task: a batch of rollouts that all time out together is not
handled one after the other (each pause waits for its disk write, and for a sandbox busy with
another operation), and one sandbox stuck on its lock holds up no other. A failed action is
retried with a growing delay (a full disk stays full for a while); the sandbox keeps running
meanwhile, so nothing is lost, and the log says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from agentenv.errors import GuestUnresponsive, SandboxNotFound
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)

REAP_CONCURRENCY = 4  # sandboxes past their timeout killed or paused at once
CHECK_EVERY_S = 0.5


class Reaper:
    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self._retry: dict[str, tuple[float, float]] = {}  # a failed timeout action: (next try, delay)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: no retry is pending for it."""
        self._retry.pop(sandbox_id, None)

    async def run(self) -> None:
        reaping: dict[str, asyncio.Task[None]] = {}
        slots = asyncio.Semaphore(REAP_CONCURRENCY)
        try:
            while True:
                await asyncio.sleep(CHECK_EVERY_S)
                now = time.time()
                for live in list(self.orch._live.values()):
                    if (live.id not in reaping and live.past_end()
                            and self._retry.get(live.id, (0.0, 0.0))[0] <= now):
                        task = asyncio.create_task(self._reap(live, slots), name=f"reap-{live.id}")
                        reaping[live.id] = task
                        task.add_done_callback(lambda _t, sid=live.id: reaping.pop(sid, None))
        finally:
            for task in list(reaping.values()):
                task.cancel()
            await asyncio.gather(*reaping.values(), return_exceptions=True)

    async def _reap(self, live: LiveSandbox, slots: asyncio.Semaphore) -> None:
        async with slots:
            pause = live.record.auto_pause and live.record.state == State.RUNNING  # a failed one is killed
            action = "pause" if pause else "kill"
            log.info("sandbox %s reached its timeout: %s", live.id, action)
            try:
                await (self._auto_pause(live) if pause else self.orch.kill(live.id, due=True))
                self._retry.pop(live.id, None)
            except SandboxNotFound:  # killed meanwhile
                self._retry.pop(live.id, None)
            except Exception as exc:  # noqa: BLE001 — background
                delay = min(60.0, 2 * self._retry.get(live.id, (0.0, 2.5))[1])
                self._retry[live.id] = (time.time() + delay, delay)
                log.error("reaper could not %s %s (%r); retrying in %.0f s", action, live.id, exc, delay)

    async def _auto_pause(self, live: LiveSandbox) -> None:
        """When the guest cannot flush its filesystems for a filesystem-only pause, its memory
        is saved instead: nothing is lost."""
        if live.record.options.get("autoPauseMemory") is False:
            try:
                await self.orch.pause(live.id, memory=False, due=True)
                return
            except GuestUnresponsive as exc:
                log.warning("%s; saving its memory instead", exc.message)
        await self.orch.pause(live.id, due=True)
