"""Acquire with undo: each resource registers its release the moment it exists.

On failure the stack unwinds in reverse order, so a failed create leaves nothing behind
(E2B's cleanup.go). Undo errors are logged, never raised over the original error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Undo = Callable[[], Awaitable[object]]


class Cleanup:
    def __init__(self, what: str) -> None:
        self.what = what
        self._stack: list[tuple[str, Undo]] = []

    def add(self, name: str, undo: Undo) -> None:
        self._stack.append((name, undo))

    def release(self) -> None:
        """Success: the resources now belong to someone else."""
        self._stack.clear()

    def done(self, name: str) -> None:
        """The resource ``name`` is being released on the normal path: never undo it again.
        Call it before the release, which may fail halfway: a second release of a network
        slot would free an index that another sandbox may hold by then."""
        self._stack = [(n, u) for n, u in self._stack if n != name]

    async def unwind(self) -> None:
        while self._stack:
            name, undo = self._stack.pop()
            try:
                await undo()
            except Exception:  # noqa: BLE001 — cleanup must go on
                log.exception("undo %s of %s failed", name, self.what)
