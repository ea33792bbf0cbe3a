"""Warm pool: restore shells kept ready per hot template snapshot.

Taking a shell removes QEMU start-up (~25 ms on KVM, more under TCG), the overlay creation
and the network slot set-up from the create path. A keeper task refills the pool in the
background; a create that finds the pool empty makes its shell inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from agentenv.network import SlotPool
from agentenv.orchestrator.shells import Shell
from agentenv.storage import TemplateSnapshot

log = logging.getLogger(__name__)

ShellFactory = Callable[[TemplateSnapshot], Awaitable[Shell]]

# After a failed refill a template's shells are tried again in RETRY_S, then twice, four times
# as long, at most MAX_RETRY_S, while the failures go on: a lasting fault (a broken image, a
# full disk, a QEMU that cannot start) costs a launch and a log line every 8 s instead of
# every second, and the other templates' refills do not wait for it.
RETRY_S = 1.0
MAX_RETRY_S = 8.0


class WarmPool:
    def __init__(self, size: int, factory: ShellFactory, slots: SlotPool, fill_concurrency: int = 2,
                 may_grow: Callable[[], bool] = lambda: True, must_shrink: Callable[[], bool] = lambda: False,
                 check_interval_s: float = 2.0) -> None:
        self.size = size
        self._may_grow = may_grow  # False while the host is short of memory: the pool waits
        self._must_shrink = must_shrink  # True while it is below its reserve: shells are given back
        self.check_interval_s = check_interval_s
        self._short = False  # the last look found the host short of memory
        self.fill_concurrency = fill_concurrency
        self._factory = factory
        self._slots = slots
        self._shells: dict[Path, list[Shell]] = {}
        self._hot: dict[Path, TemplateSnapshot] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Task[None]] = set()
        self._failures: dict[Path, int] = {}  # failed refills in a row, per template snapshot
        self._retry_at: dict[Path, float] = {}  # (loop time) no refill of that template before

    def take(self, snapshot: TemplateSnapshot) -> Shell | None:
        """A ready shell for this snapshot, or None. Marks the snapshot hot."""
        self._hot[snapshot.dir] = snapshot
        shells = self._shells.get(snapshot.dir, [])
        while shells:
            shell = shells.pop()
            if not shell.machine.exited:
                self._wake.set()
                return shell
            self._destroy_later(shell)  # its QEMU died while it waited: return its slot and dir
        self._wake.set()
        return None

    async def give_back(self, why: str) -> bool:
        """Destroy one ready shell, for a sandbox someone asked for; False when there is none.
        The pool refills once the host has room again."""
        if not await self._destroy_one():
            return False
        log.warning("warm pool: gave back a ready shell: %s", why)
        return True

    async def _destroy_one(self) -> bool:
        """Destroy one ready shell, of the template with the most; False when there is none."""
        fullest = max(self._shells.values(), key=len, default=[])
        if not fullest:
            return False
        await self._destroy_all([fullest.pop()])  # gone from the pool even if its QEMU would not die
        return True

    def _destroy_later(self, shell: Shell) -> None:
        task = asyncio.get_running_loop().create_task(self._destroy_all([shell]))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)

    async def forget(self, snapshot_dir: Path) -> None:
        """Stop keeping shells of a template snapshot (its template was deleted) and destroy them."""
        self._hot.pop(snapshot_dir, None)
        self._failures.pop(snapshot_dir, None)
        self._retry_at.pop(snapshot_dir, None)
        await self._destroy_all(self._shells.pop(snapshot_dir, []))

    async def _destroy_all(self, shells: list[Shell]) -> None:
        """Each on its own: one that fails (a QEMU that does not die) does not keep the others."""
        results = await asyncio.gather(*(s.destroy(self._slots) for s in shells), return_exceptions=True)
        for shell, r in zip(shells, results, strict=True):
            if isinstance(r, BaseException):
                log.error("warm pool: could not destroy shell %s: %r", shell.sandbox_id, r)

    def warm(self, snapshot: TemplateSnapshot) -> None:
        self._hot[snapshot.dir] = snapshot
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._keeper(), name="warm-pool")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        shells = [s for kept in self._shells.values() for s in kept]
        self._shells.clear()
        await self._destroy_all(shells)
        if self._destroying:
            await asyncio.gather(*self._destroying, return_exceptions=True)

    def fill_level(self) -> tuple[int, int]:
        """(shells ready, shells wanted) over every hot snapshot."""
        ready = sum(len(self._shells.get(k, [])) for k in self._hot)
        return ready, self.size * len(self._hot)

    async def _keeper(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # memory is looked at even when nothing wakes us
                await asyncio.wait_for(self._wake.wait(), self._next_look())
            self._wake.clear()
            try:
                if await self._shrink():
                    continue
                for key, snap in list(self._hot.items()):
                    if not await self._fill(key, snap):
                        break  # the host is short of memory: the next pass tries every template again
            except Exception:  # noqa: BLE001 — the keeper must outlive any one pass (e.g. a destroy that failed)
                log.exception("warm pool: keeping shells failed; trying again")
                await asyncio.sleep(1.0)

    async def _make_batch(self, snap: TemplateSnapshot, count: int) -> list[Shell | BaseException]:
        """``count`` shells made at once, each a shell or the error that stopped it. Cancelled
        (the pool stops), it cancels those still being made (each undoes its own work) and
        destroys those already made: nothing else holds them."""
        tasks = [asyncio.ensure_future(self._factory(snap)) for _ in range(count)]
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)
            await self._destroy_all([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
            raise
        return [t.exception() or t.result() for t in tasks]  # type: ignore[misc]

    def _next_look(self) -> float:
        """Seconds until the keeper looks again unwoken: its interval, or sooner when a
        template's retry falls due."""
        now = asyncio.get_running_loop().time()
        return max(0.0, min([self.check_interval_s, *(at - now for at in self._retry_at.values())]))

    async def _shrink(self) -> bool:
        """While the host is below its memory reserve, destroy ready shells one at a time (from
        the fullest template first), looking at the memory again after each. True if any went."""
        given_back = 0
        while self._must_shrink() and await self._destroy_one():
            given_back += 1
        if given_back:
            log.warning("warm pool: the host is below its memory reserve; destroyed %d ready shell%s",
                        given_back, "" if given_back == 1 else "s")
        return given_back > 0

    async def _fill(self, key: Path, snap: TemplateSnapshot) -> bool:
        """Refill one snapshot's shells; False (after a pause) when the host is short of memory."""
        if key not in self._hot:  # forgotten during this pass of the keeper
            return True
        shells = self._shells.setdefault(key, [])
        loop = asyncio.get_running_loop()
        if (at := self._retry_at.get(key)) is not None:
            if loop.time() < at:
                return True  # its last refill failed: not before its retry time
            del self._retry_at[key]  # due: tried now (an entry left due would make the keeper spin)
        while len(shells) < self.size and snap.mem_file.exists():
            if not self._may_grow():
                if not self._short:  # said once per episode, not every 5 s while it lasts
                    log.warning("warm pool: not refilling while the host is short of memory")
                self._short = True
                await asyncio.sleep(5.0)
                self._wake.set()
                return False
            if self._short:
                log.info("warm pool: memory is available again; refilling")
                self._short = False
            batch = min(self.fill_concurrency, self.size - len(shells))
            results = await self._make_batch(snap, batch)
            failed = [r for r in results if isinstance(r, BaseException)]
            made = [r for r in results if isinstance(r, Shell)]
            if self._shells.get(key) is not shells:  # forgotten meanwhile (its template deleted)
                await self._destroy_all(made)
                return True
            shells.extend(made)
            if failed:
                n = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(MAX_RETRY_S, RETRY_S * 2 ** (n - 1))
                self._retry_at[key] = loop.time() + delay
                log.error("warm pool could not make a shell for %s (%d failed refill%s in a row; "
                          "next try in %.0f s): %r", key, n, "" if n == 1 else "s", delay, failed[0])
                break
            self._failures.pop(key, None)
            self._retry_at.pop(key, None)
        return True
