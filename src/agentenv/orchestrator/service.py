"""The orchestrator: every sandbox operation the API may ask for, in one place.

API handlers are one call each into this class. It sequences the mechanisms (vmm, storage,
network, envd_client) and owns the lifecycle state machine; it never contains their details.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator
from pathlib import Path
from typing import Any

from agentenv.config import Settings
from agentenv.envd_client import CommandResult, EnvdClient, EnvdError, ProcessEvent
from agentenv.errors import (
    CapacityExhausted,
    GuestError,
    InvalidRequest,
    ManifestDamaged,
    NetworkError,
    PlatformError,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxStateError,
    SnapshotNotFound,
    SnapshotUnusable,
    StorageError,
)
from agentenv.images.registry import RegistrySettings
from agentenv.network import (
    DnsForwarder,
    SlotPool,
    egress_cidrs,
    host_firewall_up,
    host_resolvers,
    parse_upstreams,
    set_egress,
    uplink_networks,
)
from agentenv.orchestrator import leftovers, parking, pulling
from agentenv.orchestrator.capacity import below_reserve, memory_shortfall
from agentenv.orchestrator.checkpoints import Checkpointer
from agentenv.orchestrator.coalesce import Coalesced
from agentenv.orchestrator.idempotency import CreateOnce
from agentenv.orchestrator.lifecycle import (
    ACTIVE,
    GUEST_UP,
    State,
    allowed,
    state_error,
)
from agentenv.orchestrator.metrics import GuestMetrics
from agentenv.orchestrator.pool import WarmPool
from agentenv.orchestrator.reaper import Reaper
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.orchestrator.shells import Shell, make_shell
from agentenv.orchestrator.snapshot_shells import SnapshotShells
from agentenv.orchestrator.store import SandboxRecord, Store
from agentenv.orchestrator.templates import SnapshotBuilder, Template, TemplateCatalog
from agentenv.storage import (
    Checkpoint,
    SnapshotRepository,
    TemplateSnapshot,
    backing_chain,
    ownership,
    remove_tree,
)
from agentenv.storage import memory_layers as ml
from agentenv.vmm import AccelInfo, Machine, detect_accel, ksm

log = logging.getLogger(__name__)

INIT_RETRY_S = 5.0  # init_later: between tries, and the bound of each
# What a non-streaming exec keeps of each of its command's streams: the answer is built in the
# server's memory, and what a command prints is up to the program in the sandbox.
EXEC_OUTPUT_LIMIT = 16 << 20
STOP_WAIT_S = 30.0  # stop: how long an operation cut short may take to finish its clean-up


async def _acquire(lock: asyncio.Lock, timeout: float) -> bool:
    """Take ``lock`` within ``timeout`` seconds; False (not taken) after that."""
    try:
        await asyncio.wait_for(lock.acquire(), timeout)
    except TimeoutError:
        log.warning("an operation did not finish its clean-up within %.0f s of the stop", timeout)
        return False
    return True


async def together(*work: Coroutine[Any, Any, object]) -> None:
    """Run ``work`` concurrently; on the first failure cancel the rest, wait for them, and
    raise that failure itself (not a group: the API maps it to its status)."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Orchestrator:
    """The node's sandboxes and what serves them. Its public methods are what the API calls.

    Its underscored members (``_live``, ``_require``, ``_save``, ``_transition``, ``_record``, ``_revert``, ``_fail``, ``_watch``,
    ``_in_background``) are the orchestrator package's own: the helper modules
    beside this one (forking, pausing, parking, recovery, snapshot_shells) take the
    orchestrator as their first argument and use them, so that the lifecycle of one sandbox
    lives in several small files instead of one large class. Nothing outside the package
    uses them."""

    def __init__(self, settings: Settings, registry: RegistrySettings | None = None) -> None:
        self.settings = settings
        Machine.qmp_timeout_s = settings.qmp_timeout_s
        self.accel: AccelInfo = detect_accel(settings.accel)
        self.sandboxes_dir = settings.data_dir / "sandboxes"
        self.store = Store(settings.db_path)
        self.catalog = TemplateCatalog(settings.data_dir / "templates")
        self.slots = SlotPool(settings.instance_tag, settings.slot_cidr, settings.slot_pool_size, dns=settings.dns)
        self.dns: DnsForwarder | None = None
        self.snapshots = SnapshotBuilder(
            root=settings.data_dir / "templates", mem_dir=settings.mem_dir, sock_dir=settings.sock_dir,
            slots=self.slots,
            accel=self.accel, boot_timeout_s=settings.boot_timeout_s, tb_size_mb=settings.tcg_tb_size_mb,
            tcg_cpu=settings.tcg_cpu,
            guest_aslr=settings.guest_aslr,
        )
        self.pool = WarmPool(settings.pool_size, self._make_shell, self.slots,
                             # It stops a sandbox short of where creates stop: the headroom
                             # they are admitted into is not the pool's to fill.
                             may_grow=lambda: memory_shortfall(settings.mem_reserve_mb, 2) is None,
                             # parked VMs go first (orchestrator/parking.py)
                             must_shrink=lambda: below_reserve(settings.mem_reserve_mb) and not parking.parked(self))
        # Primed sandboxes of the snapshots sandboxes were recently started from (a GRPO reset)
        self.snapshot_shells = SnapshotShells(self, settings.snapshot_pool_size, settings.snapshot_pool_idle_s,
                                              max_size=settings.snapshot_pool_max)
        self.creates = CreateOnce(self.list)  # creates and forks under an Idempotency-Key
        self.repo = SnapshotRepository(settings.repository, spare_bytes=settings.spare_layers_mb << 20)
        self.checkpoints = Checkpointer(
            self.repo, catalog=self.catalog, sock_dir=settings.sock_dir, accel=self.accel, tb_size_mb=settings.tcg_tb_size_mb,
            restore_timeout_s=settings.restore_timeout_s, max_memory_layers=settings.max_memory_layers,
            faults=settings.faults, max_disk_layers=settings.max_disk_layers, guest_aslr=settings.guest_aslr)
        self._live: dict[str, LiveSandbox] = {}
        # Memory files a VM maps (or is about to) outside any sandbox's ``vm``: kept from gc
        # and template clean-up (see ``claiming``).
        self._claimed: collections.Counter[str] = collections.Counter()
        self._owned: list[int] = []  # locks on the data dir and the repository (storage/ownership.py)
        self._tasks: list[asyncio.Task[None]] = []
        self._cleanups: set[asyncio.Task[object]] = set()  # see _in_background
        self._gc_requests = Coalesced(self.gc, lambda work: self._in_background(work, "gc"))
        self.guest_metrics = GuestMetrics()
        self.reaper = Reaper(self)
        self._admitting = 0  # VMs admitted and starting, not yet in _live (see admitted())
        self._admitting_mb = 0  # ... and what they take beyond SANDBOX_MIN_MB each
        self._admitted_ids: set[str] = set()  # listed sandboxes counted in _admitting (resumes)
        self._starting: list[Checkpoint] = []  # saved states sandboxes are being started from
        self.registry = registry or RegistrySettings()  # where images are pulled from (server.py reads the env)
        self._image_locks: dict[str, asyncio.Lock] = {}
        self.image_gate = asyncio.Lock()  # image clean-ups and the start of pulls (pulling.py)
        self.pulls_in_progress = 0
        self.image_cleanup_wanted = False  # skipped while pulls ran: the last one to end runs it
        from agentenv.orchestrator.builds import Builds

        self.builds = Builds(self)  # template builds from steps (orchestrator/builds)

    # -- start / stop ---------------------------------------------------------------------

    async def start(self) -> None:
        """Install host rules, re-adopt the sandboxes of a previous run, start background work."""
        from agentenv.orchestrator.recovery import recover

        # Before anything is cleaned up or recovered: these must be this server's alone.
        self._owned.append(ownership.hold(
            self.settings.data_dir, "the data directory",
            "another AgentENV server runs on it: stop that one, or give this one its own AENV_DATA_DIR"))
        self._owned.append(ownership.hold(
            self.settings.repository, "the snapshot repository",
            "nodes cannot share one yet (each node's recovery and garbage collection would delete the "
            "other's snapshots): give each node its own AENV_REPOSITORY_DIR"))
        ownership.make_private(self.settings.data_dir, self.settings.repository, self.settings.mem_dir)
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        if self.settings.ksm:  # before the first QEMU starts: the mark is inherited at fork
            await asyncio.to_thread(ksm.merge_children)
            log.info("KSM on: QEMU processes are mergeable; ksmd scans at the host's rate")
        await asyncio.to_thread(leftovers.record_owner, self.settings)
        await leftovers.remove_leftovers(self.settings)
        await asyncio.to_thread(pulling.remove_interrupted, self.settings.data_dir / "images")
        dns_addr = self.slots.dns_addr if self.settings.dns else None
        await host_firewall_up(self.settings.instance_tag, self.slots.ifprefix, self.settings.slot_cidr, dns_addr,
                               await self._denied_networks())
        if dns_addr is not None:
            await self._start_dns(dns_addr)
        await recover(self)
        self._in_background(asyncio.to_thread(ml.warm_buffers), "making the memory copy buffers")
        await self.builds.start()
        self.pool.start()
        self.snapshot_shells.start()
        self._tasks.append(asyncio.create_task(self._prepare_templates(), name="prepare-templates"))
        self._tasks.append(asyncio.create_task(self.reaper.run(), name="ttl-reaper"))
        self._tasks.append(asyncio.create_task(self._slot_keeper(), name="slot-keeper"))
        self._tasks.append(asyncio.create_task(parking.keeper(self), name="parked-keeper"))

    async def _denied_networks(self) -> list[str]:
        """What no sandbox reaches beyond the always-denied private ranges: AENV_DENY_OUT, and
        (unless AENV_DENY_UPLINK=off) the network of the host's uplink."""
        try:
            denied = egress_cidrs([v for v in self.settings.deny_out.split(",") if v.strip()], "AENV_DENY_OUT")
        except InvalidRequest as exc:
            raise NetworkError(exc.message) from None
        if self.settings.deny_uplink:
            denied += [n for n in await uplink_networks() if n not in denied]
        if denied:
            log.info("sandboxes reach none of %s (AENV_DENY_OUT, AENV_DENY_UPLINK)", ", ".join(denied))
        return denied

    async def _start_dns(self, listen: str) -> None:
        try:
            upstreams = parse_upstreams(self.settings.dns_upstream) or host_resolvers()
        except ValueError as exc:
            raise NetworkError(str(exc)) from None
        if not upstreams:
            log.warning("no DNS resolver in /etc/resolv.conf and none in AENV_DNS_UPSTREAM: guests cannot resolve names")
            return
        self.dns = DnsForwarder(listen, upstreams)
        try:
            await self.dns.start()
        except OSError as exc:
            raise NetworkError(f"cannot start the guests' DNS forwarder on {listen}:53: {exc}; "
                               "set AENV_DNS=off to run without it") from exc

    async def stop(self) -> None:
        """Leave running sandboxes running (they are adopted on the next start), or pause them
        first when configured to (AENV_PAUSE_ON_STOP)."""
        if self.settings.pause_on_stop:
            await self.pause_all()
        tasks = list(self._tasks)  # (init_later tasks leave the list as they end)
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        await asyncio.gather(*self._cleanups, return_exceptions=True)
        if self.dns is not None:
            await self.dns.close()
        await self.pool.stop()
        await self.snapshot_shells.stop()
        await self.slots.drain()
        for live in list(self._live.values()):  # (a create cut short meanwhile leaves the dict)
            # The server cancels requests still running when it stops, without waiting for
            # them: an operation cut short (a pause continuing its VM after a failed capture)
            # finishes its clean-up before its VM's QMP connection is closed under it.
            held = await _acquire(live.lock, STOP_WAIT_S)
            try:
                parking.evict(self, live, why="the server stops")  # its state is saved
                await live.settled()
                if live.machine:
                    await live.machine.detach()
                if live.envd:
                    await live.envd.aclose()
            finally:
                if held:
                    live.lock.release()
        self.store.close()
        for fd in self._owned:
            os.close(fd)
        self._owned.clear()
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

    async def get_settled(self, sandbox_id: str) -> SandboxRecord:
        """The record, once a create or a kill in progress has ended: E2B clients know only
        running and paused sandboxes, and a sandbox being killed is, to them, already gone."""
        live = self._live.get(sandbox_id)
        if live is not None and live.record.state in (State.CREATING, State.KILLING):
            async with live.lock:
                pass
        return self.get(sandbox_id)

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
        if timeout_s < 0:
            raise InvalidRequest(f"timeout must be 0 or more seconds, got {timeout_s}")
        if timeout_s > self.settings.max_timeout_s:
            limit = self.settings.max_timeout_s
            raise InvalidRequest(f"Timeout cannot be greater than {limit // 3600} hours" if limit % 3600 == 0
                                 else f"Timeout cannot be greater than {limit} seconds")
        return timeout_s

    def _active(self) -> int:
        """Sandboxes that hold a running VM (parked VMs are counted apart), and those admitted
        and still starting (not yet in ``_live``)."""
        return self._admitting + sum(1 for s in self._live.values()
                                     if s.record.state in ACTIVE and s.id not in self._admitted_ids)

    def check_count(self, more: int = 1) -> None:
        """Raise CapacityExhausted unless ``more`` sandboxes fit in AENV_MAX_SANDBOXES."""
        if (active := self._active()) + more > self.settings.max_sandboxes:
            raise CapacityExhausted(
                f"this node runs {active} of its maximum of {self.settings.max_sandboxes} sandboxes; "
                f"kill or pause some, or retry later")

    async def admit(self, more: int = 1, extra_mb: int = 0) -> None:
        """Raise CapacityExhausted unless ``more`` new VMs fit: by count, and by host memory,
        once parked VMs (their state is saved), then warm-pool shells (idle sandboxes nobody
        asked for yet) have been freed for it. Parked VMs count against AENV_MAX_SANDBOXES
        too, so they never hold more VMs (and slots) than it. Both limits are looked at again
        after every wait, with no wait between the last look and the caller's count
        (``admitted``): creates that came in meanwhile may have taken the room."""
        while True:
            if self._active() + len(parking.parked(self)) + more > self.settings.max_sandboxes:
                if await parking.evict_oldest(self, "room for a new VM (AENV_MAX_SANDBOXES)"):
                    continue
            self.check_count(more)
            # Sandboxes admitted and still starting have not taken their memory yet: counted here.
            why = self.memory_for(more, extra_mb)
            if why is None:
                return
            if not (await parking.evict_oldest(self, "memory for a new VM")
                    or await self.pool.give_back(f"memory for a new VM ({why})")
                    or await self.snapshot_shells.give_back()):
                raise CapacityExhausted(f"{why}: kill or pause some sandboxes, or retry later", retry_after=5)

    @contextlib.asynccontextmanager
    async def admitted(self, more: int = 1, starting: Checkpoint | None = None,
                       extra_mb: int = 0, sandbox_id: str | None = None) -> AsyncIterator[None]:
        """``admit`` ``more`` new VMs and count them until the caller has put them in ``_live``
        (or failed), so that creates running at once see each other against the limits.
        ``starting``: the saved state they start from, kept from gc meanwhile (its snapshot
        may be deleted while they start), from before the admission waits (it may free parked
        VMs and shells, and a gc may run meanwhile). ``extra_mb``: see ``memory_shortfall``.
        ``sandbox_id``: a listed sandbox that gets a new VM (a resume): counted here only, not
        also as the active sandbox it becomes meanwhile (a resume counted twice made creates
        near the limit 429 and evicted parked VMs for room that was there)."""
        with self.pinning(starting):
            await self.admit(more, extra_mb)
            with self.counting(more, extra_mb):
                if sandbox_id is not None:
                    self._admitted_ids.add(sandbox_id)
                try:
                    yield
                finally:
                    self._admitted_ids.discard(sandbox_id or "")

    @contextlib.contextmanager
    def counting(self, more: int = 1, extra_mb: int = 0) -> Iterator[None]:
        """Count ``more`` VMs starting (and ``extra_mb`` of memory they are about to take)
        until they are in ``_live`` or failed: admissions meanwhile see them."""
        self._admitting += more
        self._admitting_mb += extra_mb
        try:
            yield
        finally:
            self._admitting -= more
            self._admitting_mb -= extra_mb

    def memory_for(self, more: int = 1, extra_mb: int = 0) -> str | None:
        """What the host lacks for ``more`` VMs beyond those admitted and starting (None: enough),
        for background work that must not eat into the reserve (see ``memory_shortfall``)."""
        return memory_shortfall(self.settings.mem_reserve_mb, more + self._admitting, extra_mb + self._admitting_mb)

    @contextlib.contextmanager
    def pinning(self, cp: Checkpoint | None) -> Iterator[None]:
        """Keep ``cp``'s layers from the gc while a sandbox starts from it: its snapshot may be
        deleted meanwhile. (Rebound, not changed in place: the gc reads it from a thread; one
        entry per start, as several may start from the same checkpoint object at once.)"""
        if cp is None:
            yield
            return
        self._starting = [*self._starting, cp]
        try:
            yield
        finally:
            rest = list(self._starting)
            del rest[next(i for i, c in enumerate(rest) if c is cp)]
            self._starting = rest

    async def create(self, template: str, *, vcpus: int | None = None, memory_mb: int | None = None,
                     timeout_s: int | None = None, metadata: dict[str, str] | None = None,
                     env_vars: dict[str, str] | None = None, options: dict[str, Any] | None = None) -> SandboxRecord:
        """Restore a new sandbox from the template's snapshot (or from a named snapshot, whose
        id or name may stand for ``template``); returns once its agent answers.
        ``options``: see ``SandboxRecord.options``; its "network" is checked by ``egress_policy``."""
        options = dict(options or {})
        if "network" in options:
            options["network"] = self.egress_policy(options["network"])
        if ":" in template and not self.repo.exists(template):
            from agentenv.orchestrator.builds import tags

            template = tags.resolve(template, self.builds, self.catalog)  # name:tag → name
        if not self.catalog.exists(template) and self.repo.exists(template):
            from agentenv.orchestrator.forking import create_from_snapshot

            return await create_from_snapshot(self, template, timeout_s=timeout_s, metadata=metadata,
                                              env_vars=env_vars, options=options)
        t = self.catalog.get(template)
        v, m = self.validate_shape(t, vcpus, memory_mb)
        timeout = self.validate_timeout(self.settings.default_timeout_s if timeout_s is None else timeout_s)
        for attempt in range(3):
            async with self.admitted():
                snap = await self.snapshots.get(t, v, m)
                # Claimed until the sandbox is listed: a pull may retire the snapshot meanwhile.
                with self.claiming(snap.dir, snap.mem_file):
                    pooled = self.pool.take(snap)
                    shell = pooled or await self._make_shell(snap, prime=False)
                    now = time.time()
                    rec = SandboxRecord(
                        id=shell.sandbox_id, template=t.name, state=State.CREATING, vcpus=v, memory_mb=m,
                        disk_mb=t.disk_mb, started_at=now, end_at=now + timeout, access_token=shell.access_token,
                        run_dir=str(shell.run_dir), metadata=dict(metadata or {}), env_vars=dict(env_vars or {}),
                        slot_index=shell.slot.index, options=options, base_dir=str(snap.dir),
                        disk_path=str(shell.run_dir / "disk.qcow2"), auto_pause=bool(options.get("autoPause")),
                        timeout_s=timeout,
                    )
                    live = LiveSandbox(rec, shell.machine, shell.slot, shell.envd)
                    self._live[rec.id] = live
            async with live.lock:  # an operation on it meanwhile (a kill) waits for the create to end
                try:
                    # Not persisted while creating: if the server dies now, the run dir has no record
                    # and recovery kills its QEMU and removes it; the caller got no answer and retries.
                    if shell.frozen:  # primed: its guest runs again only once activated (cont)
                        await self._apply_egress(live, restrictive_only=True)
                        await self._restore(live, shell)
                    else:  # made inline, running and sending nothing out (shells.make_shell)
                        await together(self._apply_egress(live), self._restore(live, shell))
                except BaseException as exc:
                    # A ready shell whose QEMU died while it waited (before the loop saw it go):
                    # not the caller's problem, another shell serves the create.
                    died = pooled is not None and isinstance(exc, PlatformError) and not shell.machine.alive()
                    reason = exc.message if isinstance(exc, PlatformError) else f"create failed: {exc!r}"
                    if not await self._fail(live, reason):
                        raise  # kept, listed as error with what it still holds: a kill tries again
                    self._live.pop(rec.id, None)
                    await self.store.delete(rec.id)
                    await remove_tree(shell.run_dir)
                    if died and attempt < 2:
                        log.warning("ready shell %s had died (%s); the create takes another", rec.id, reason)
                        continue
                    raise
            return live.record
        raise AssertionError("unreachable")

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
                                restore_timeout_s=self.settings.restore_timeout_s, prime=prime,
                                nice=self.settings.background_nice)

    # -- kill, timeout, failure -------------------------------------------------------------

    async def kill(self, sandbox_id: str, *, due: bool = False) -> None:
        """``due``: the reaper's kill, done only if the sandbox still runs past its end time
        once the lock is free (a pause or a new timeout may have come first)."""
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(sandbox_id)
        async with live.lock:
            if self._live.get(sandbox_id) is not live:  # its create failed meanwhile
                raise SandboxNotFound(sandbox_id)
            if live.record.state == State.KILLING:
                return
            if due and not live.past_end():
                return
            await self._transition(live, State.KILLING)
            if (parked := parking.take(live)) is not None:  # released below, as a running VM
                live.machine, live.envd, live.slot = parked.machine, parked.envd, parked.slot
            await live.settled()
            # The namespace goes after the answer: deleting its links waits for the kernel's
            # RCU grace periods (20-130 ms measured), not for anything the caller needs.
            # Its index stays taken until then; a crash before is cleaned by recovery.
            slot, live.slot = live.slot, None
            try:
                await self._release(live)
            except BaseException as exc:
                # (QEMU did not go after SIGKILL, e.g. stuck in the kernel.) The sandbox stays
                # listed, as error, with its slot: a later kill tries again, and frees the slot.
                live.slot = slot
                await self._save(live, state=State.ERROR, error=f"kill failed: {exc}")
                raise
            if slot is not None:
                self._in_background(self.slots.release(slot), f"removing the namespace of {sandbox_id}")
            self._live.pop(sandbox_id, None)
            self.guest_metrics.forget(sandbox_id)
            self.reaper.forget(sandbox_id)
            try:
                await self.store.delete(sandbox_id)
            finally:  # a store that fails keeps the record (killing: the next start ends it), not the files
                await remove_tree(Path(live.record.run_dir))
                if live.record.paused is not None:
                    await self.drop_checkpoint(live.record.paused.id)
        self.schedule_gc()

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        live = self._live.get(sandbox_id)
        if live is not None and live.record.state == State.PAUSED:
            # A paused sandbox has no timeout running; E2B answers 404 (the wire contract).
            raise SandboxNotRunning(sandbox_id, "paused", "setting its timeout")
        live = self._require(sandbox_id, GUEST_UP)
        self.validate_timeout(timeout_s)
        return await self._save(live, end_at=time.time() + timeout_s, timeout_s=timeout_s)

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

    async def _fail(self, live: LiveSandbox, reason: str) -> bool:
        """Free what the sandbox holds and record it as error. Returns False when freeing
        failed (a QEMU that does not exit after SIGKILL, stuck in the kernel): the record then
        says so and keeps the slot it still holds, persisted, so that a kill, now or after a
        restart, tries again instead of the sandbox vanishing with its resources."""
        log.error("sandbox %s failed: %s", live.id, reason)
        freed = True
        try:
            await self._release(live)
        except Exception as exc:  # noqa: BLE001 — reported in the record, retried by a kill
            log.exception("sandbox %s: freeing its resources failed", live.id)
            reason, freed = f"{reason}; freeing its resources failed ({exc}): a kill tries again", False
        if live.record.state != State.ERROR and allowed(live.record.state, State.ERROR):
            # In error all the same if the store fails (a restart then finds its VM gone).
            await self._record(live, state=State.ERROR, error=reason, slot_index=live.slot.index if live.slot else None,
                               end_at=max(live.record.end_at, time.time() + self.settings.error_keep_s))
        return freed

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

    async def _save(self, live: LiveSandbox, update: Callable[[SandboxRecord], SandboxRecord] | None = None, /, *,
                    best_effort: bool = False, **changes: Any) -> SandboxRecord:
        """Write ``changes`` (and ``update``, for a change that depends on the record, e.g. a
        merge into its options) to the sandbox's record as it is when its turn comes. Writers
        that do not hold the sandbox's lock (set_timeout, refresh, connect's extension) and an
        operation that does (a fork, a network update) each change their own fields, one
        write at a time: a record computed before another writer's turn and written after it
        would undo that writer's change (a timeout the caller was told is set, lost).

        By default the record is written, then taken: a store that fails (StorageError)
        changes nothing. ``best_effort``: a record that states what already happened is taken
        at once and its write failure only logged (``_record``)."""
        async with live.saving:
            new = (update(live.record) if update is not None else live.record).with_(**changes)
            if best_effort:
                live.record = new
            write = asyncio.ensure_future(self.store.put(new))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # (The server stops.) The write runs on in its thread: wait for it, so that the
                # record in memory says what the store says (a revert by the caller then
                # reaches the store after it, not before).
                await asyncio.wait({write})
                if not write.cancelled() and write.exception() is None:
                    live.record = new
                raise
            except StorageError:
                if not best_effort:
                    raise
                log.exception("sandbox %s: recording it as %s failed", live.id, new.state.value)
            live.record = new
            return new

    async def _transition(self, live: LiveSandbox, dst: State, **changes: Any) -> None:
        """Recorded, then taken, with ``changes`` to other fields of the record made with it:
        a store that fails (StorageError) leaves the sandbox as it was, in memory as on disk,
        not in a transition nothing will finish."""
        src = live.record.state
        if not allowed(src, dst):
            raise SandboxStateError(live.id, src.value, f"in a state that can become {dst.value}")
        await self._save(live, state=dst, **changes)
        log.info("sandbox %s: %s -> %s", live.id, src.value, dst.value)
        if dst == State.RUNNING:
            self.notice_exit(live)

    async def _record(self, live: LiveSandbox, **changes: Any) -> None:
        """Take a record that states what has already happened (a VM that now runs, one that
        was continued after a failed operation): at once, since it is the truth whatever the
        store says, and written best effort. A failed write is logged; the store then still
        holds the transition, which the next start's recovery settles from the VM it finds
        (docs/mechanisms/recovery.md). Raising instead would leave the operation's own
        bookkeeping (exit watcher, manifests) half done over a VM that runs."""
        await self._save(live, best_effort=True, **changes)

    async def _revert(self, live: LiveSandbox, dst: State, **changes: Any) -> None:
        """Back to the state a failed operation left the sandbox in (its VM continued, or its
        saved state kept), with ``changes``, through ``_record``."""
        log.info("sandbox %s: %s -> %s (reverted)", live.id, live.record.state.value, dst.value)
        await self._record(live, state=dst, **changes)
        if dst == State.RUNNING:
            self.notice_exit(live)

    def init_later(self, live: LiveSandbox) -> None:
        """A guest that did not answer its resume in time may only be slow (a loaded host): give
        it the clock and its identity once it answers, trying every few seconds for a minute.
        Cancelled when the server stops, or when the sandbox stops running on this agent."""
        envd = live.envd

        async def attempts() -> None:
            for _ in range(12):
                await asyncio.sleep(INIT_RETRY_S)
                if envd is None or live.envd is not envd or live.record.state not in GUEST_UP:
                    return
                try:
                    await live.reidentify(envd, INIT_RETRY_S)
                except (EnvdError, asyncio.TimeoutError, OSError):
                    continue
                log.info("sandbox %s: its guest answered after the resume; it has the clock now", live.id)
                return
            log.warning("sandbox %s: its guest still does not answer a minute after its resume", live.id)

        task = asyncio.get_running_loop().create_task(attempts(), name=f"init-later-{live.id}")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def notice_exit(self, live: LiveSandbox) -> None:
        """Call when an operation has set ``live`` running again: its QEMU may have died during
        the operation, when the exit watcher (which acts on running sandboxes) let it be."""
        if live.record.state == State.RUNNING and live.machine is not None and live.machine.exited:
            self._in_background(self._on_machine_exit(live), f"failing {live.id}")

    def _require(self, sandbox_id: str, states: Collection[State]) -> LiveSandbox:
        live = self._live.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(sandbox_id)
        if live.record.state not in states:
            required = "running" if states is GUEST_UP else "/".join(sorted(s.value for s in states))
            raise state_error(sandbox_id, live.record.state, required, live.record.error)
        return live

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
        live = self._require(sandbox_id, GUEST_UP)
        assert live.envd is not None
        return live.envd

    async def exec(self, sandbox_id: str, cmd: str | list[str], *, envs: dict[str, str] | None = None,
                   cwd: str | None = None, user: str | None = None, timeout: float | None = None) -> CommandResult:
        return await self.envd(sandbox_id).run(cmd, envs=envs, cwd=cwd, user=user, timeout=timeout,
                                               max_output=EXEC_OUTPUT_LIMIT)

    def exec_stream(self, sandbox_id: str, cmd: str | list[str], **kw: object) -> AsyncIterator[ProcessEvent]:
        return self.envd(sandbox_id).stream(cmd, **kw)  # type: ignore[arg-type]

    def abandon_command(self, sandbox_id: str, pid: int) -> None:
        """Kill a command whose caller went away before its end (Ctrl-C on ``aenv exec``), as a
        local command goes with its terminal. In the background: the caller's request is being
        torn down; a sandbox or process already gone is no error."""
        async def kill() -> None:
            try:
                await self.envd(sandbox_id).send_signal(pid, "SIGKILL")
            except (SandboxNotFound, SandboxStateError, EnvdError):
                pass

        self._in_background(kill(), f"killing command {pid} of {sandbox_id}")

    # -- saved states: pause, resume, snapshot, fork (orchestrator/pausing.py, forking.py) --

    async def pull(self, image: str, *, name: str | None = None, username: str | None = None,
                   password: str | None = None, disk_mb: int | None = None) -> Template:
        """Make (or update) a template from an OCI image; see orchestrator/pulling.py."""
        return await pulling.pull(self, image, name=name, username=username, password=password, disk_mb=disk_mb)

    async def delete_image_template(self, name: str) -> None:
        """Forget a template pulled from an image. Its template snapshots (memory files on
        tmpfs) go at once unless a sandbox or a saved state still starts from them; those stay
        until the last user is gone (the next ``remove_stale``: a delete, or a server start).
        The image's OCI layout and ext4 go too once no template uses them, unless a pull is in
        progress (``pulling.clean_unused_images``)."""
        t = self.catalog.get(name)
        if t.image is None:
            raise InvalidRequest(f"'{name}' is a built-in template and cannot be deleted")
        await asyncio.to_thread(self.catalog.delete, name)
        await self.retire_template_snapshots(name)
        await pulling.clean_unused_images(self)

    async def retire_template_snapshots(self, name: str) -> None:
        """Template ``name`` was deleted or now starts from something else: its cached template
        snapshots are dropped and their ready shells destroyed at once; the snapshots' files go
        once no sandbox or saved state starts from them (``remove_stale``)."""
        self.snapshots.forget(name)
        for d in self.snapshots.dirs_of(name):
            await self.pool.forget(d)
        await self.snapshots.remove_stale(self.catalog, self.template_snapshots_in_use)

    def template_snapshots_in_use(self) -> set[str]:
        """Template snapshot dirs and memory files that sandboxes or saved states start from,
        or that a create, fork or wake in progress has claimed."""
        bases = {r.record.base_dir for r in self._live.values()} | {cp.base for cp in self.repo.list()}
        return bases | self._mapped()

    def _mapped(self) -> set[str]:
        return {str(r.vm.spec.mem_path) for r in self._live.values() if r.vm is not None} | set(self._claimed)

    @contextlib.contextmanager
    def claiming(self, *paths: Path) -> Iterator[None]:
        """Keep these files (memory files, template snapshot dirs) from gc and template
        clean-up while they are used outside any sandbox's ``vm``: a template snapshot from the
        moment a create looked it up until its sandbox is listed, a fork's memory file until
        its children are, a parked VM while it is being woken (it is then neither parked nor
        the sandbox's machine). Synchronous on purpose: taken with no await after the lookup."""
        keys = [str(p) for p in paths]
        self._claimed.update(keys)
        try:
            yield
        finally:
            self._claimed.subtract(keys)
            for k in keys:
                if self._claimed[k] <= 0:
                    del self._claimed[k]

    def image_lock(self, key: str) -> asyncio.Lock:
        """One conversion at a time per output file (two pulls of one image wait for each other)."""
        return self._image_locks.setdefault(key, asyncio.Lock())

    async def pause(self, sandbox_id: str, *, memory: bool = True, require_healthy: bool = False,
                    due: bool = False) -> SandboxRecord:
        """``memory=False``: filesystem-only (resumed by a cold boot of its disk). ``due``: the
        reaper's (see ``pausing.pause``)."""
        from agentenv.orchestrator.pausing import pause

        return await pause(self, sandbox_id, memory=memory, require_healthy=require_healthy, due=due)

    async def resume(self, sandbox_id: str, timeout_s: int | None = None, *, memory: bool = True,
                     auto_pause: bool | None = None) -> SandboxRecord:
        """``memory=False``: boot its disk instead of restoring its memory. ``auto_pause``
        (E2B's deprecated resume route): pause instead of kill at its next timeout, or not."""
        from agentenv.orchestrator.pausing import resume

        try:
            rec = await resume(self, sandbox_id, timeout_s, memory)
        except GuestError:  # it may run all the same (its guest did not answer in time)
            live = self._live.get(sandbox_id)
            if auto_pause is not None and live is not None and live.record.state in GUEST_UP:
                await self._set_auto_pause(sandbox_id, auto_pause)
            raise
        return rec if auto_pause is None else await self._set_auto_pause(sandbox_id, auto_pause)

    async def _set_auto_pause(self, sandbox_id: str, auto_pause: bool) -> SandboxRecord:
        live = self._require(sandbox_id, GUEST_UP)
        if live.record.auto_pause == auto_pause:
            return live.record

        def with_auto_pause(r: SandboxRecord) -> SandboxRecord:
            options = {**r.options, "autoPause": auto_pause}
            if not auto_pause:
                options.pop("autoPauseMemory", None)  # (it qualifies an auto-pause)
            return r.with_(auto_pause=auto_pause, options=options)

        return await self._save(live, with_auto_pause)

    async def connect(self, sandbox_id: str, timeout_s: int | None = None, *,
                      memory: bool = True) -> tuple[SandboxRecord, bool]:
        """Running: extend the timeout (never shorten) → (record, False). Paused: resume →
        (record, True)."""
        from agentenv.orchestrator.pausing import connect

        return await connect(self, sandbox_id, timeout_s, memory)

    async def pause_all(self) -> None:
        from agentenv.orchestrator.pausing import pause_all

        await pause_all(self)

    async def snapshot(self, sandbox_id: str, name: str | None = None, *, memory: bool = True) -> Checkpoint:
        from agentenv.orchestrator.forking import snapshot

        return await snapshot(self, sandbox_id, name, memory)

    async def fork(self, sandbox_id: str, count: int = 1, timeout_s: int | None = None,
                   idempotency: dict[str, str] | None = None) -> list[SandboxRecord | Exception]:
        """``idempotency``: the option each child records (a fork under an Idempotency-Key)."""
        from agentenv.orchestrator.forking import fork

        return await fork(self, sandbox_id, count, timeout_s, idempotency)

    def list_snapshots(self, sandbox_id: str | None = None) -> list[Checkpoint]:
        return [c for c in self.repo.list("snapshot") if sandbox_id is None or c.source_sandbox == sandbox_id]

    async def delete_snapshot(self, id_or_name: str) -> None:
        try:
            cp = self.repo.get(id_or_name)
        except ManifestDamaged:
            # A manifest that does not parse (cut by a host crash, or damaged) stops every gc:
            # deleting it by id must work, unless something of this node still holds it. (A
            # read that failed for a passing reason is a SnapshotUnusable: nothing is deleted.)
            if holder := next((sid for sid, live in self._live.items()
                               if live.record.paused is not None and live.record.paused.id == id_or_name), None):
                raise SnapshotUnusable(f"snapshot {id_or_name}: its manifest is unreadable and it is the saved "
                                       f"state of paused sandbox {holder}; kill that sandbox to remove both") from None
            built = await asyncio.to_thread(self.builds.templates)
            if template := next((t.template_id for t in built if t.checkpoint == id_or_name), None):
                raise SnapshotUnusable(f"snapshot {id_or_name}: its manifest is unreadable and it is the checkpoint "
                                       f"of template {template}; delete the template to remove both") from None
            log.warning("deleting unreadable manifest %s", id_or_name)
            await self.drop_checkpoint(id_or_name)
            await self.gc()
            return
        if cp.kind != "snapshot":
            raise SnapshotNotFound(id_or_name)
        await self.snapshot_shells.forget(cp.id)
        await self.drop_checkpoint(cp.id)
        await self.gc()

    # -- repository garbage collection ----------------------------------------------------

    async def drop_checkpoint(self, cp_id: str) -> None:
        """Delete a manifest under the repository lock, so that a gc in progress, which read
        the sandboxes' references before a record took the layers over, still sees it."""
        async with self.repo.lock:
            await asyncio.to_thread(self.repo.delete, cp_id)

    def pins(self) -> set[str]:
        """Layers the sandboxes of this node need: their origins, paused states and the disk
        chains under their overlays (read from the qcow2 headers). The overlay a VM writes to
        is its machine's (a snapshot switches it before the record follows); if one that must
        exist cannot be read, every disk layer is kept."""
        out: set[str] = set()
        for cp in self._starting:
            out |= cp.layer_names()
        unreadable = []
        for live in list(self._live.values()):
            rec = live.record
            out |= rec.pins()
            vm = live.vm
            must = [str(vm.spec.disk)] if vm is not None else []
            if rec.paused and rec.paused.disk_top:
                must.append(rec.paused.disk_top)
            for top in {*must, rec.disk_path}:
                if not top:
                    continue
                if top in must and not os.path.exists(top):
                    unreadable.append(f"{rec.id}: {top}")
                out |= {p.name for p in backing_chain(Path(top)) if p.parent == self.repo.layers}
        if unreadable:
            log.warning("gc keeps every disk layer: overlays not found (%s)", ", ".join(unreadable))
            out |= {p.name for p in self.repo.layers.glob("disk-*")}
        return out

    async def gc(self, staging_older_than: float = 600.0) -> list[str]:
        """Delete the layers nothing needs. Under the repository lock, which every hand-off of
        layers from a manifest to a sandbox record also takes to delete the manifest: the
        references are read as of one moment."""
        def collect() -> list[str]:
            return self.repo.gc(self.pins(), staging_older_than)

        async with self.repo.lock:
            try:
                removed = await asyncio.to_thread(collect)
            except StorageError as exc:
                log.error("repository gc skipped: %s", exc.message)
                removed = []
        # A fork child's VM maps its fork's memory file while it runs, while it is parked, and
        # while it is being woken; a fork in progress claims it from before it is written.
        mapped = self._mapped()
        unused = [f for f in self.settings.mem_dir.glob("fork-*.mem") if str(f) not in mapped]
        for f in unused:  # a fork's memory file no child maps any more (GiBs of tmpfs: freed off the loop)
            await asyncio.to_thread(f.unlink, True)
            removed.append(f.name)
        return removed

    def schedule_gc(self) -> None:
        """A gc after the caller has its answer; the requests made while one runs share one
        more run (orchestrator/coalesce.py)."""
        self._gc_requests.request()

    def _in_background(self, work: Coroutine[Any, Any, object], what: str) -> asyncio.Task[object]:
        """Run host clean-up after the caller has its answer. The task is kept (the loop holds
        only a weak reference) and ``stop`` waits for it; a failure is logged."""
        task = asyncio.get_running_loop().create_task(work)
        self._cleanups.add(task)

        def done(t: asyncio.Task[object]) -> None:
            self._cleanups.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %r", what, t.exception())

        task.add_done_callback(done)
        return task

    # -- E2B surface: egress policy, refresh, proxy routes, metrics -----------------------

    @staticmethod
    def egress_policy(network: dict[str, Any]) -> dict[str, Any]:
        """Check and normalise a sandbox's network options: ``allowOut``/``denyOut`` (IPv4
        addresses and CIDRs; allow beats deny), ``allowPublicTraffic``, ``maskRequestHost``."""
        out: dict[str, Any] = {
            "allowOut": egress_cidrs(network.get("allowOut"), "network.allowOut"),
            "denyOut": egress_cidrs(network.get("denyOut"), "network.denyOut"),
        }
        if network.get("allowPublicTraffic") is not None:
            out["allowPublicTraffic"] = bool(network["allowPublicTraffic"])
        if network.get("maskRequestHost"):
            out["maskRequestHost"] = str(network["maskRequestHost"])
        return out

    async def _apply_egress(self, live: LiveSandbox, restrictive_only: bool = False) -> None:
        """The sandbox's egress policy (none: everything outside the always-denied ranges).
        ``restrictive_only``: the namespace allows everything already; only a policy changes it."""
        net = live.record.options.get("network") or {}
        if live.slot is not None and (net.get("allowOut") or net.get("denyOut") or not restrictive_only):
            await set_egress(live.slot, net.get("allowOut", []), net.get("denyOut", []))

    async def update_network(self, sandbox_id: str, allow_out: list[str] | None,
                             deny_out: list[str] | None) -> SandboxRecord:
        """Replace the egress rules of a running sandbox (omitted lists are cleared). The record
        is written first, then the rules: a store that fails changes nothing, and a server that
        stops in between finds the record's rules put back by its recovery (``recover``)."""
        policy = self.egress_policy({"allowOut": allow_out, "denyOut": deny_out})
        live = self._require(sandbox_id, {State.RUNNING})
        async with live.lock:
            live = self._require(sandbox_id, {State.RUNNING})
            assert live.slot is not None
            before = {k: live.record.options[k] for k in ("network", "allowInternetAccess") if k in live.record.options}

            def with_policy(r: SandboxRecord) -> SandboxRecord:
                # The create-time allowInternetAccess no longer describes the rules: the
                # sandbox's detail derives it from the lists from now on.
                options = {k: v for k, v in r.options.items() if k != "allowInternetAccess"}
                return r.with_(options={**options, "network": {**(r.options.get("network") or {}), **policy}})

            def as_before(r: SandboxRecord) -> SandboxRecord:
                options = {k: v for k, v in r.options.items() if k not in ("network", "allowInternetAccess")}
                return r.with_(options={**options, **before})

            net = (await self._save(live, with_policy)).options["network"]
            try:
                await set_egress(live.slot, net["allowOut"], net["denyOut"])
            except BaseException:
                # Best effort: a record the store did not take back is put back by recovery.
                await self._save(live, as_before, best_effort=True)
                raise
        return live.record

    async def refresh(self, sandbox_id: str, duration_s: int) -> SandboxRecord:
        """Keep a running sandbox alive for at least ``duration_s`` more seconds (never shortens)."""
        live = self._require(sandbox_id, GUEST_UP)
        self.validate_timeout(duration_s)
        return await self._save(live, lambda r: r.with_(end_at=max(r.end_at, time.time() + duration_s)))

    def template_created_at(self, name: str) -> float:
        """When the template's definition was last written (unix seconds)."""
        return (self.catalog.root / name / "template.json").stat().st_mtime

    def parked_vms(self) -> int:
        """Paused sandboxes whose stopped VM is kept for a quick resume (orchestrator/parking.py)."""
        return len(parking.parked(self))

    def memory_merging(self) -> dict[str, object]:
        """Whether this server marks its QEMU processes for KSM, and the host's KSM figures."""
        st = ksm.stats()
        return {"enabled": self.settings.ksm, "ksmdRunning": bool(st and st.running),
                "pagesSharing": st.pages_sharing if st else 0, "profitBytes": st.profit_bytes if st else 0}

    def guest_address(self, sandbox_id: str) -> str:
        """The address at which the host reaches every port of a running sandbox's guest."""
        live = self._require(sandbox_id, GUEST_UP)
        assert live.slot is not None
        return live.slot.ns_addr

    async def metrics(self, sandbox_id: str, start: float | None = None, end: float | None = None,
                      running_only: bool = False) -> list[dict[str, Any]]:
        """Resource samples of a sandbox inside [start, end] (unix seconds), each a dict with
        E2B's SandboxMetric fields: those taken while it ran, plus a new one if it runs
        (orchestrator/metrics.py)."""
        live = self._require(sandbox_id, GUEST_UP if running_only else set(State))
        return await self.guest_metrics.points(live, start, end, sample=live.record.state in GUEST_UP)
