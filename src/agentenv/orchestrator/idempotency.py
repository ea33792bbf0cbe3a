"""Idempotent creates and forks: a create or fork retried with the same ``Idempotency-Key``
gets the sandboxes the first attempt made, not new ones.

A trainer whose create or fork timed out (a 504 from a load balancer, a dropped connection,
Ctrl-C in ``aenv``) cannot tell whether sandboxes were made; retrying blindly leaks them, not
retrying loses a rollout. With a key, the retry is safe: while the first attempt is still
running the retry waits for it, and afterwards it is answered with the same sandboxes (same
ids and tokens). The key and a fingerprint of the request are kept in each sandbox's record
(a fork's in each child's), so this holds across a server restart and lasts as long as the
sandboxes. A key reused with a different request is refused; a key whose first attempt
failed, or whose sandboxes all failed or are gone, makes new ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from agentenv.errors import IdempotencyKeyReused, InvalidRequest
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.store import SandboxRecord

OPTION = "idempotency"  # SandboxRecord.options[OPTION] = {"key": ..., "fingerprint": ...}
MAX_KEY_LENGTH = 255

T = TypeVar("T")


class CreateOnce:
    """Serialises creates and forks per key; ``records`` lists the node's sandboxes (the
    store's truth)."""

    def __init__(self, records: Callable[[], Iterable[SandboxRecord]]) -> None:
        self._records = records
        self._pending: dict[str, asyncio.Future[None]] = {}

    async def create(self, key: str, fingerprint: str,
                     make: Callable[[dict[str, str]], Awaitable[SandboxRecord]]) -> tuple[SandboxRecord, bool]:
        """The sandbox for ``key``: an existing one (``True``: replayed) or one ``make`` creates
        now with the option to record (``False``)."""
        found, made = await self._once(key, fingerprint, make, "create")
        if found:
            return found[0], True
        assert made is not None
        return made, False

    async def fork(self, key: str, fingerprint: str,
                   make: Callable[[dict[str, str]], Awaitable[T]]) -> tuple[list[SandboxRecord], T | None]:
        """The children for ``key`` still alive (a replay: ``None`` made), or ``make``'s result
        now, each child recording the option it is given."""
        return await self._once(key, fingerprint, make, "fork")

    async def _once(self, key: str, fingerprint: str,
                    make: Callable[[dict[str, str]], Awaitable[T]], what: str) -> tuple[list[SandboxRecord], T | None]:
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise InvalidRequest(f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} printable characters")
        while (pending := self._pending.get(key)) is not None:  # the first attempt is running
            await asyncio.shield(pending)
        found = self._existing(key)
        if found:
            if any(rec.options[OPTION].get("fingerprint") != fingerprint for rec in found):
                raise IdempotencyKeyReused(
                    f"Idempotency-Key '{key}' was used for a different {what} request (sandbox "
                    f"{found[0].id}); use a new key for a new request")
            return found, None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            return [], await make({"key": key, "fingerprint": fingerprint})
        finally:
            del self._pending[key]
            done.set_result(None)

    def _existing(self, key: str) -> list[SandboxRecord]:
        return [rec for rec in self._records()
                if rec.state not in (State.ERROR, State.KILLING) and (rec.options.get(OPTION) or {}).get("key") == key]
