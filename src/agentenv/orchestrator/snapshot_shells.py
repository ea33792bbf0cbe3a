"""Ready sandboxes for hot snapshots: the GRPO reset without a cold start.

A trainer resets an episode by killing its sandbox and starting a new one from the same
snapshot (``POST /sandboxes/{id}/snapshots``), again and again. Starting from a snapshot restores a new QEMU (the memory layers
written into its RAM, the device state loaded) whose translation cache is empty: under TCG its
guest agent first answers after about 300 ms. A create from a template takes a primed shell of
the warm pool instead (pool.py, ~16 ms). This does the same for snapshots: once a sandbox has
been started from a snapshot, a few more are started from it ahead of time, each with its
own id, token and fresh entropy, primed with the warm-up commands and frozen. A create from
that snapshot takes one, continues it with the clock, the create's env vars and its network
policy, and records it. A snapshot nobody started from for ``idle_s`` is cold again and its
shells are destroyed; deleting the snapshot destroys them first. At most ``MAX_HOT`` snapshots
are hot at once (the least recently used goes).

A GRPO group resets together: its G rollouts start from the episode's snapshot at once. So a
snapshot keeps ``size`` shells until more starts from it are under way at the same time, and
then as many as the most that ever were (its largest burst), up to ``max_size`` (a group's
worth, ``AENV_SNAPSHOT_POOL_MAX``): the first group pays its cold restores, the next ones
find theirs ready. Resets one after another are no burst, however close together. A snapshot
that goes cold forgets its bursts. Shells take memory as running sandboxes do:
one is made only while the host has room for it beyond the reserve (counted, while it is
restored, at the size of the layers it writes into its RAM, as a resume is), and below the
reserve they are destroyed. A snapshot whose shell could not be made (its priming failed, or
took longer than the restore timeout) gets none for ``RETRY_AFTER_S``.

Shells have no record: after a server crash their run dirs have none, and the next start's
recovery kills their QEMUs and removes the dirs, as it does for the warm pool's shells.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.errors import AgentenvError
from agentenv.network import set_egress
from agentenv.orchestrator import parking
from agentenv.orchestrator.capacity import below_reserve
from agentenv.orchestrator.forking import Started, start_from_checkpoint
from agentenv.orchestrator.ids import new_access_token, new_sandbox_id
from agentenv.storage import Checkpoint, remove_tree

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
MAX_HOT = 8  # snapshots with shells at once
RETRY_AFTER_S = 60.0  # after a shell of a snapshot could not be made
MAKE_MARGIN_S = 30.0  # making one (restore + priming) may take the restore timeout plus this


@dataclass
class SnapshotShell:
    sandbox_id: str
    access_token: str
    run_dir: Path
    started: Started


class SnapshotShells:
    def __init__(self, orch: Orchestrator, size: int, idle_s: float, max_size: int | None = None) -> None:
        self._orch = orch
        self.size = size
        self.max_size = size if max_size is None else max_size
        self.idle_s = idle_s
        self._starting: collections.Counter[str] = collections.Counter()  # checkpoint id → starts under way
        self._bursts: dict[str, int] = {}  # checkpoint id → the most starts under way at once
        self._failed: dict[str, float] = {}  # checkpoint id → when making a shell of it failed
        self._shells: dict[str, list[SnapshotShell]] = {}  # by checkpoint id
        self._hot: dict[str, tuple[Checkpoint, float]] = {}  # checkpoint id → (it, last start from it)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def starting(self, cp: Checkpoint) -> Iterator[SnapshotShell | None]:
        """A start from ``cp``: a ready shell of it, or None (see ``take``), and the start
        counted while it lasts, so that the snapshot keeps as many shells as its largest burst."""
        shell = self.take(cp)
        if cp.id not in self._hot:
            yield shell
            return
        self._starting[cp.id] += 1
        self._bursts[cp.id] = max(self._bursts.get(cp.id, 0), self._starting[cp.id])
        try:
            yield shell
        finally:
            self._starting[cp.id] -= 1
            if self._starting[cp.id] <= 0:
                del self._starting[cp.id]

    def take(self, cp: Checkpoint) -> SnapshotShell | None:
        """A ready sandbox started from ``cp``, or None. Marks ``cp`` hot (snapshots only, named
        or not: a template's checkpoint has the warm pool)."""
        if self.size <= 0 or cp.kind != "snapshot":
            return None
        now = time.monotonic()
        if now - self._failed.get(cp.id, -RETRY_AFTER_S) >= RETRY_AFTER_S:
            self._hot.pop(cp.id, None)  # (re)inserted last: the most recently used
            self._hot[cp.id] = (cp, now)
            self._wake.set()
        shells = self._shells.get(cp.id, [])
        while shells:
            shell = shells.pop()
            if not shell.started.machine.exited:
                return shell
            self._destroy_later(shell)  # its QEMU died while it waited
        return None

    def wanted(self, cp_id: str) -> int:
        """Shells kept ready for this snapshot: ``size``, or its largest burst."""
        return max(self.size, min(self.max_size, self._bursts.get(cp_id, 0)))

    def discard(self, shell: SnapshotShell) -> None:
        """A taken shell that could not be handed out."""
        self._destroy_later(shell)

    async def forget(self, cp_id: str) -> None:
        """Keep no shells of the snapshot (it is being deleted, or it is cold); a fill under way
        destroys what it makes once it sees the snapshot is no longer hot."""
        self._hot.pop(cp_id, None)
        self._bursts.pop(cp_id, None)
        for shell in self._shells.pop(cp_id, []):
            self._destroy_later(shell)  # each on its own: one that fails does not keep the others
        await self._destroyed()

    async def give_back(self) -> bool:
        """Destroy one ready shell, for a sandbox someone asked for; False when there is none."""
        fullest = max(self._shells.values(), key=len, default=[])
        if not fullest:
            return False
        self._destroy_later(fullest.pop())
        await self._destroyed()
        log.warning("snapshot shells: gave back a ready shell for memory")
        return True

    def fill_level(self) -> tuple[int, int]:
        """(shells ready, shells wanted) over every hot snapshot."""
        return sum(len(self._shells.get(k, [])) for k in self._hot), sum(self.wanted(k) for k in self._hot)

    def start(self) -> None:
        if self.size > 0:
            self._task = asyncio.create_task(self._keeper(), name="snapshot-shells")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._hot.clear()
        for shells in self._shells.values():
            for shell in shells:
                self._destroy_later(shell)
        self._shells.clear()
        await self._destroyed()

    async def _destroyed(self) -> None:
        if self._destroying:
            await asyncio.gather(*self._destroying, return_exceptions=True)

    async def _keeper(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CHECK_INTERVAL_S)
            self._wake.clear()
            try:
                await self._cool()
                while below_reserve(self._orch.settings.mem_reserve_mb) and await self.give_back():
                    pass
                for cp_id in list(self._hot):
                    await self._fill(cp_id)
            except Exception:  # noqa: BLE001 — background: the next pass tries again
                log.exception("snapshot shells: keeping shells failed")
                await asyncio.sleep(1.0)

    async def _cool(self) -> None:
        now = time.monotonic()
        self._failed = {k: t for k, t in self._failed.items() if now - t < RETRY_AFTER_S}
        hot = list(self._hot.items())
        for i, (cp_id, (_, used)) in enumerate(hot):
            if now - used >= self.idle_s:
                log.info("snapshot %s is cold (nothing started from it for %.0f s): its shells go",
                         cp_id, self.idle_s)
                await self.forget(cp_id)
            elif i < len(hot) - MAX_HOT:  # the least recently used beyond MAX_HOT
                await self.forget(cp_id)
            elif not self._exists(cp_id):  # deleted while a create marked it hot again
                await self.forget(cp_id)

    def _exists(self, cp_id: str) -> bool:
        try:
            return self._orch.repo.exists(cp_id)
        except AgentenvError:  # a manifest that no longer reads: no more shells of it
            return False

    async def _fill(self, cp_id: str) -> None:
        """Make shells for one hot snapshot, one at a time (each is a restore plus priming on
        the node's CPUs, next to the running sandboxes)."""
        while cp_id in self._hot and len(self._shells.setdefault(cp_id, [])) < self.wanted(cp_id):
            cp = self._hot[cp_id][0]
            layers_mb = sum(r.size for r in cp.memory) >> 20
            if self._orch.memory_for(2, layers_mb) is not None:  # as the warm pool: one short of creates
                return
            try:
                bound = self._orch.settings.restore_timeout_s + MAKE_MARGIN_S
                with self._orch.counting(1, layers_mb):
                    shell = await asyncio.wait_for(self._make(cp), bound)
            except Exception as exc:  # noqa: BLE001 — e.g. the snapshot was deleted meanwhile
                log.warning("snapshot shells: could not start one from %s (%s); none for %.0f s", cp_id,
                            getattr(exc, "message", None) or repr(exc), RETRY_AFTER_S)
                self._failed[cp_id] = time.monotonic()
                await self.forget(cp_id)
                return
            shells = self._shells.get(cp_id)
            if cp_id not in self._hot or shells is None:  # forgotten meanwhile (deleted, cold)
                await self._destroy(shell)
                return
            shells.append(shell)

    async def _make(self, cp: Checkpoint) -> SnapshotShell:
        sandbox_id, token = new_sandbox_id(), new_access_token()
        run_dir = self._orch.sandboxes_dir / sandbox_id
        try:
            with self._orch.pinning(cp):
                # Nothing goes out while it primes: a create's policy is applied before it runs.
                started = await start_from_checkpoint(
                    self._orch, cp, sandbox_id=sandbox_id, access_token=token, template=cp.name or cp.id,
                    env_vars={}, run_dir=run_dir, options={"network": {"denyOut": ["0.0.0.0/0"]}},
                    nice=self._orch.settings.background_nice)
        except BaseException:
            await remove_tree(run_dir)
            raise
        shell = SnapshotShell(sandbox_id, token, run_dir, started)
        try:
            await started.envd.warm_up()
            await started.machine.qmp("stop")
            await set_egress(started.slot, [], [])  # frozen, it opens nothing (see shells.py)
        except BaseException:
            await self._destroy(shell)
            raise
        return shell

    async def _destroy(self, shell: SnapshotShell) -> None:
        """Logged when it fails (a QEMU that does not die): nobody awaits these tasks but
        ``_destroyed``, which drops what they raise."""
        try:
            await parking.free(self._orch, shell.started.machine, shell.started.envd, shell.started.slot)
        except Exception:
            log.exception("snapshot shells: could not destroy shell %s", shell.sandbox_id)
            raise
        finally:
            await remove_tree(shell.run_dir)

    def _destroy_later(self, shell: SnapshotShell) -> None:
        task = asyncio.get_running_loop().create_task(self._destroy(shell))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)
