"""Idempotent creates: a create retried with the same ``Idempotency-Key`` gets the sandbox the
first attempt made, not a second one.

A trainer whose create timed out (a 504 from a load balancer, a dropped connection) cannot
tell whether a sandbox was made; retrying blindly leaks one, not retrying loses a rollout.
With a key, the retry is safe: while the first attempt is still running the retry waits for
it, and afterwards it is answered with the same sandbox (same id and tokens). The key and a
fingerprint of the request are kept in the sandbox's record, so this holds across a server
restart and lasts as long as the sandbox. A key reused with a different request is refused;
a key whose first attempt failed, or whose sandbox failed or is gone, makes a new sandbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from agentenv.errors import IdempotencyKeyReused, InvalidRequest
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.store import SandboxRecord

OPTION = "idempotency"  # SandboxRecord.options[OPTION] = {"key": ..., "fingerprint": ...}
MAX_KEY_LENGTH = 255


class CreateOnce:
    """Serialises creates per key; ``records`` lists the node's sandboxes (the store's truth)."""

    def __init__(self, records: Callable[[], Iterable[SandboxRecord]]) -> None:
        self._records = records
        self._pending: dict[str, asyncio.Future[None]] = {}

    async def create(self, key: str, fingerprint: str,
                     make: Callable[[dict[str, str]], Awaitable[SandboxRecord]]) -> tuple[SandboxRecord, bool]:
        """The sandbox for ``key``: an existing one (``True``: replayed) or one ``make`` creates
        now with the option to record (``False``)."""
        if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
            raise InvalidRequest(f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} printable characters")
        while (pending := self._pending.get(key)) is not None:  # the first attempt is running
            await asyncio.shield(pending)
        rec = self._existing(key)
        if rec is not None:
            if rec.options[OPTION].get("fingerprint") != fingerprint:
                raise IdempotencyKeyReused(
                    f"Idempotency-Key '{key}' was used for a different create request (sandbox "
                    f"{rec.id}); use a new key for a new request")
            return rec, True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            rec = await make({"key": key, "fingerprint": fingerprint})
        finally:
            del self._pending[key]
            done.set_result(None)
        return rec, False

    def _existing(self, key: str) -> SandboxRecord | None:
        for rec in self._records():
            if rec.state not in (State.ERROR, State.KILLING) and (rec.options.get(OPTION) or {}).get("key") == key:
                return rec
        return None
