"""One background job, however often it is asked for: requests that arrive while it runs are
served by a single further run.

The repository's garbage collection is asked for after every kill, resume and fork. Each run
reads every sandbox's disk chain and every manifest under the node-wide repository lock: when
a training step ends and a thousand rollouts are killed, a run per kill queued tens of seconds
of collection on that lock, and every pause, snapshot and fork waited behind it. One run that
starts after a request sees everything that request freed, so one is enough.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class Coalesced:
    """``request()`` makes sure ``job`` runs, in full, after it; ``start`` runs a coroutine in
    the background (the orchestrator's, so that its stop waits for it)."""

    def __init__(self, job: Callable[[], Awaitable[object]],
                 start: Callable[[Coroutine[Any, Any, None]], asyncio.Task[object]]) -> None:
        self._job = job
        self._start = start
        self._wanted = False
        self._runner: asyncio.Task[object] | None = None

    def request(self) -> None:
        self._wanted = True
        if self._runner is None or self._runner.done():
            self._runner = self._start(self._run())

    async def _run(self) -> None:
        while self._wanted:
            self._wanted = False  # a request from here on gets a run that starts after it
            try:
                await self._job()
            except Exception:  # noqa: BLE001 — logged; the requests made meanwhile still get their run
                log.exception("background job %s failed", getattr(self._job, "__name__", self._job))
