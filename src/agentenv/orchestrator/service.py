"""The orchestrator: every sandbox operation the API may ask for, in one place.

API handlers are one call each into this class. It sequences the mechanisms (vmm, storage,
network, envd_client) and owns the lifecycle state machine; it never contains their details.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from agentenv.config import Settings
from agentenv.envd_client import CommandResult, EnvdClient, ProcessEvent
from agentenv.errors import (
    CapacityExhausted,
    InvalidRequest,
    PlatformError,
    SandboxNotFound,
    SandboxStateError,
    SnapshotNotFound,
)
from agentenv.network import SlotPool, host_firewall_up
from agentenv.orchestrator.checkpoints import Checkpointer
from agentenv.orchestrator.lifecycle import ACTIVE, State, allowed
from agentenv.orchestrator.pool import WarmPool
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.orchestrator.shells import Shell, make_shell
from agentenv.orchestrator.store import SandboxRecord, Store
from agentenv.orchestrator.templates import SnapshotBuilder, Template, TemplateCatalog
from agentenv.storage import (
    Checkpoint,
    SnapshotRepository,
    TemplateSnapshot,
    backing_chain,
    remove_tree,
)
from agentenv.vmm import AccelInfo, detect_accel

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.accel: AccelInfo = detect_accel(settings.accel)
        self.sandboxes_dir = settings.data_dir / "sandboxes"
        self.store = Store(settings.db_path)
        self.catalog = TemplateCatalog(settings.data_dir / "templates")
        self.slots = SlotPool(settings.instance_tag, settings.slot_cidr, settings.slot_pool_size)
        self.snapshots = SnapshotBuilder(
            root=settings.data_dir / "templates", mem_dir=settings.mem_dir, sock_dir=settings.sock_dir,
            slots=self.slots,
            accel=self.accel, boot_timeout_s=settings.boot_timeout_s, tb_size_mb=settings.tcg_tb_size_mb,
            guest_aslr=settings.guest_aslr,
        )
        self.pool = WarmPool(settings.pool_size, self._make_shell, self.slots)
        self.repo = SnapshotRepository(settings.repository)
        self.checkpoints = Checkpointer(
            self.repo, sock_dir=settings.sock_dir, accel=self.accel, tb_size_mb=settings.tcg_tb_size_mb,
            restore_timeout_s=settings.restore_timeout_s, max_memory_layers=settings.max_memory_layers,
            faults=settings.faults)
        self._live: dict[str, LiveSandbox] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- start / stop ---------------------------------------------------------------------

    async def start(self) -> None:
        """Install host rules, re-adopt the sandboxes of a previous run, start background work."""
        from agentenv.orchestrator.recovery import recover

        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        await host_firewall_up(self.settings.instance_tag, self.slots.ifprefix, self.settings.slot_cidr)
        await recover(self)
        self.pool.start()
        self._tasks.append(asyncio.create_task(self._prepare_templates(), name="prepare-templates"))
        self._tasks.append(asyncio.create_task(self._reaper(), name="ttl-reaper"))
        self._tasks.append(asyncio.create_task(self._slot_keeper(), name="slot-keeper"))

    async def stop(self) -> None:
        """Leave running sandboxes running (they are adopted on the next start), or pause them
        first when configured to (AENV_PAUSE_ON_STOP)."""
        if self.settings.pause_on_stop:
            await self.pause_all()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        await self.pool.stop()
        await self.slots.drain()
        for live in self._live.values():
            await live.settled()
            if live.machine:
                await live.machine.detach()
            if live.envd:
                await live.envd.aclose()
        self.store.close()
        running = sum(1 for s in self._live.values() if s.record.state == State.RUNNING)
        paused = sum(1 for s in self._live.values() if s.record.state == State.PAUSED)
        log.info("orchestrator stopped cleanly; %d running and %d paused sandboxes left for the next start",
                 running, paused)

    # -- queries --------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(sandbox_id)
        return live.record

    def list(self, states: set[State] | None = None, metadata: dict[str, str] | None = None) -> list[SandboxRecord]:
        out = []
        for live in self._live.values():
            r = live.record
            if states and r.state not in states:
                continue
            if metadata and any(r.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(r)
        return sorted(out, key=lambda r: r.started_at, reverse=True)

    def templates(self) -> list[Template]:
        return self.catalog.list()

    # -- create ---------------------------------------------------------------------------

    def validate_shape(self, t: Template, vcpus: int | None, memory_mb: int | None) -> tuple[int, int]:
        v = t.vcpus if vcpus is None else vcpus
        m = t.memory_mb if memory_mb is None else memory_mb
        if not 1 <= v <= self.settings.max_vcpus:
            raise InvalidRequest(f"cpuCount must be between 1 and {self.settings.max_vcpus}, got {v}")
        if not 128 <= m <= self.settings.max_memory_mb or m % 2:
            raise InvalidRequest(
                f"memoryMB must be an even number between 128 and {self.settings.max_memory_mb}, got {m}")
        return v, m

    def validate_timeout(self, timeout_s: int) -> int:
        if timeout_s < 0 or timeout_s > self.settings.max_timeout_s:
            raise InvalidRequest(f"timeout must be between 0 and {self.settings.max_timeout_s} seconds, got {timeout_s}")
        return timeout_s

    def check_capacity(self, more: int = 1) -> None:
        active = sum(1 for s in self._live.values() if s.record.state in ACTIVE)
        if active + more > self.settings.max_sandboxes:
            raise CapacityExhausted(
                f"this node runs {active} of its maximum of {self.settings.max_sandboxes} sandboxes; "
                f"kill or pause some, or retry later")

    async def create(self, template: str, *, vcpus: int | None = None, memory_mb: int | None = None,
                     timeout_s: int | None = None, metadata: dict[str, str] | None = None,
                     env_vars: dict[str, str] | None = None, auto_pause: bool = False) -> SandboxRecord:
        """Restore a new sandbox from the template's snapshot (or from a named snapshot);
        returns once its agent answers."""
        if not self.catalog.exists(template) and self.repo.exists(template):
            from agentenv.orchestrator.forking import create_from_snapshot

            return await create_from_snapshot(self, template, timeout_s=timeout_s, metadata=metadata,
                                              env_vars=env_vars, auto_pause=auto_pause)
        t = self.catalog.get(template)
        v, m = self.validate_shape(t, vcpus, memory_mb)
        timeout = self.validate_timeout(self.settings.default_timeout_s if timeout_s is None else timeout_s)
        self.check_capacity()
        snap = await self.snapshots.get(t, v, m)
        shell = self.pool.take(snap) or await self._make_shell(snap, prime=False)
        now = time.time()
        rec = SandboxRecord(
            id=shell.sandbox_id, template=t.name, state=State.CREATING, vcpus=v, memory_mb=m,
            disk_mb=t.disk_mb, started_at=now, end_at=now + timeout, access_token=shell.access_token,
            run_dir=str(shell.run_dir), metadata=dict(metadata or {}), env_vars=dict(env_vars or {}),
            slot_index=shell.slot.index, base_dir=str(snap.dir), disk_path=str(shell.run_dir / "disk.qcow2"),
            auto_pause=auto_pause, timeout_s=timeout,
        )
        live = LiveSandbox(rec, shell.machine, shell.slot, shell.envd)
        self._live[rec.id] = live
        try:
            # Not persisted while creating: if the server dies now, the run dir has no record
            # and recovery kills its QEMU and removes it; the caller got no answer and retries.
            await self._restore(live, shell)
        except BaseException as exc:
            reason = exc.message if isinstance(exc, PlatformError) else f"create failed: {exc!r}"
            await self._fail(live, reason)
            self._live.pop(rec.id, None)
            await self.store.delete(rec.id)
            await remove_tree(shell.run_dir)
            raise
        return live.record

    async def _restore(self, live: LiveSandbox, shell: Shell) -> None:
        t0 = time.perf_counter()
        await shell.activate(template=live.record.template, env_vars=live.record.env_vars,
                             timeout_s=self.settings.restore_timeout_s, faults=self.settings.faults)
        t1 = time.perf_counter()
        live.envd = shell.envd
        self._watch(live)
        await self._transition(live, State.RUNNING)
        log.debug("activate %s: %.1f ms, then store %.1f ms", live.id, (t1 - t0) * 1e3,
                  (time.perf_counter() - t1) * 1e3)

    async def _make_shell(self, snap: TemplateSnapshot, prime: bool = True) -> Shell:
        return await make_shell(snap, sandboxes_dir=self.sandboxes_dir, sock_dir=self.settings.sock_dir,
                                slots=self.slots, accel=self.accel, tb_size_mb=self.settings.tcg_tb_size_mb,
                                restore_timeout_s=self.settings.restore_timeout_s, prime=prime)

    # -- kill, timeout, failure -------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(sandbox_id)
        async with live.lock:
            if live.record.state == State.KILLING:
                return
            await self._transition(live, State.KILLING)
            await live.settled()
            await self._release(live)
            self._live.pop(sandbox_id, None)
            await self.store.delete(sandbox_id)
            await remove_tree(Path(live.record.run_dir))
            if live.record.paused is not None:
                self.repo.delete(live.record.paused.id)
        self.schedule_gc()

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        live = self._require(sandbox_id, {State.RUNNING})
        self.validate_timeout(timeout_s)
        live.record = live.record.with_(end_at=time.time() + timeout_s, timeout_s=timeout_s)
        await self.store.put(live.record)
        return live.record

    async def _release(self, live: LiveSandbox) -> None:
        """Free the host resources of a sandbox (process, slot, client); keeps the record."""
        if live.envd:
            await live.envd.aclose()
            live.envd = None
        if live.machine:
            await live.machine.kill()
            live.machine = None
        if live.slot:
            await self.slots.release(live.slot)
            live.slot = None

    async def _fail(self, live: LiveSandbox, reason: str) -> None:
        log.error("sandbox %s failed: %s", live.id, reason)
        await self._release(live)
        if live.record.state != State.ERROR and allowed(live.record.state, State.ERROR):
            live.record = live.record.with_(state=State.ERROR, error=reason, slot_index=None)
            await self.store.put(live.record)

    def _watch(self, live: LiveSandbox) -> None:
        machine = live.machine
        if machine is None:
            return

        def exited() -> None:
            if live.machine is machine and live.record.state == State.RUNNING:
                asyncio.get_running_loop().create_task(self._on_machine_exit(live))

        machine.on_exit(exited)

    async def _on_machine_exit(self, live: LiveSandbox) -> None:
        async with live.lock:
            if live.record.state != State.RUNNING:
                return
            tail = live.machine.spec.console_tail(300) if live.machine else ""
            await self._fail(live, "QEMU exited unexpectedly (killed or crashed)" + (f"; console: {tail}" if tail else ""))

    async def _transition(self, live: LiveSandbox, dst: State) -> None:
        src = live.record.state
        if not allowed(src, dst):
            raise SandboxStateError(live.id, src.value, f"in a state that can become {dst.value}")
        live.record = live.record.with_(state=dst)
        await self.store.put(live.record)
        log.info("sandbox %s: %s -> %s", live.id, src.value, dst.value)

    def _require(self, sandbox_id: str, states: set[State]) -> LiveSandbox:
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(sandbox_id)
        if live.record.state not in states:
            raise SandboxStateError(sandbox_id, live.record.state.value, "/".join(s.value for s in states))
        return live

    async def _reaper(self) -> None:
        """Kill (or, with auto-pause, pause) running sandboxes whose timeout has passed."""
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for live in list(self._live.values()):
                if live.record.state == State.RUNNING and live.record.end_at <= now:
                    action = "pause" if live.record.auto_pause else "kill"
                    log.info("sandbox %s reached its timeout: %s", live.id, action)
                    try:
                        await (self.pause(live.id) if live.record.auto_pause else self.kill(live.id))
                    except Exception:  # noqa: BLE001 — background
                        log.exception("reaper could not %s %s", action, live.id)

    async def _prepare_templates(self) -> None:
        """Snapshot every template in its default shape and fill its pool, in the background,
        so that the first create after a start is as fast as the next ones."""
        for t in self.catalog.list():
            try:
                self.pool.warm(await self.snapshots.get(t, t.vcpus, t.memory_mb))
            except Exception:  # noqa: BLE001 — background; a create will report the error
                log.exception("could not prepare template %s", t.name)

    async def _slot_keeper(self) -> None:
        while True:
            try:
                await self.slots.fill()
            except Exception:  # noqa: BLE001 — background
                log.exception("slot pool refill failed")
            await asyncio.sleep(1.0)

    # -- data plane -----------------------------------------------------------------------

    def envd(self, sandbox_id: str) -> EnvdClient:
        live = self._require(sandbox_id, {State.RUNNING})
        assert live.envd is not None
        return live.envd

    async def exec(self, sandbox_id: str, cmd: str | list[str], *, envs: dict[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None, timeout: float | None = None) -> CommandResult:
        return await self.envd(sandbox_id).run(cmd, envs=envs, cwd=cwd, user=user, timeout=timeout)

    def exec_stream(self, sandbox_id: str, cmd: str | list[str], **kw: object) -> AsyncIterator[ProcessEvent]:
        return self.envd(sandbox_id).stream(cmd, **kw)  # type: ignore[arg-type]

    # -- saved states: pause, resume, snapshot, fork (orchestrator/pausing.py, forking.py) --

    async def pause(self, sandbox_id: str) -> SandboxRecord:
        from agentenv.orchestrator.pausing import pause

        return await pause(self, sandbox_id)

    async def resume(self, sandbox_id: str, timeout_s: int | None = None) -> SandboxRecord:
        from agentenv.orchestrator.pausing import resume

        return await resume(self, sandbox_id, timeout_s)

    async def connect(self, sandbox_id: str, timeout_s: int | None = None) -> tuple[SandboxRecord, bool]:
        """Running: extend the timeout (never shorten) → (record, False). Paused: resume →
        (record, True)."""
        from agentenv.orchestrator.pausing import connect

        return await connect(self, sandbox_id, timeout_s)

    async def pause_all(self) -> None:
        from agentenv.orchestrator.pausing import pause_all

        await pause_all(self)

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> Checkpoint:
        from agentenv.orchestrator.forking import snapshot

        return await snapshot(self, sandbox_id, name)

    async def fork(self, sandbox_id: str, count: int = 1,
                   timeout_s: int | None = None) -> list[SandboxRecord | Exception]:
        from agentenv.orchestrator.forking import fork

        return await fork(self, sandbox_id, count, timeout_s)

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[Checkpoint]:
        return [c for c in self.repo.list("snapshot")
                if (sandbox_id is None or c.source_sandbox == sandbox_id) and (name is None or c.name == name)]

    async def delete_snapshot(self, id_or_name: str) -> None:
        cp = self.repo.get(id_or_name)
        if cp.kind != "snapshot":
            raise SnapshotNotFound(id_or_name)
        self.repo.delete(cp.id)
        await self.gc()

    # -- repository garbage collection ----------------------------------------------------

    def pins(self) -> set[str]:
        """Layers the sandboxes of this node need: their origins, paused states and the disk
        chains under their overlays (read from the qcow2 headers)."""
        out: set[str] = set()
        for live in list(self._live.values()):
            rec = live.record
            out |= rec.pins()
            tops = [rec.disk_path] + ([rec.paused.disk_top] if rec.paused and rec.paused.disk_top else [])
            for top in tops:
                if top:
                    out |= {p.name for p in backing_chain(Path(top)) if p.parent == self.repo.layers}
        return out

    async def gc(self, staging_older_than: float = 600.0) -> list[str]:
        async with self.repo.lock:
            pins = await asyncio.to_thread(self.pins)
            return await asyncio.to_thread(self.repo.gc, pins, staging_older_than)

    def schedule_gc(self) -> None:
        task = asyncio.get_running_loop().create_task(self.gc())
        task.add_done_callback(lambda t: t.cancelled() or t.exception() and log.error("gc failed: %r", t.exception()))
