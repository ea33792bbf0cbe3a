"""Pause and resume (and E2B's connect, which resumes when needed).

Pause: ``running → pausing`` → checkpoint (memory layer + device state; the disk overlay
stays where it is, no longer written) → ``paused`` with the checkpoint in the record. The
stopped VM is then parked for a while (orchestrator/parking.py), or killed and its network
slot returned. The sandbox holds no CPU; once its VM is freed, no guest RAM either: its state
is files in the repository plus its overlay. A failed capture (e.g. a full disk) continues the
VM and returns the sandbox to ``running`` with the error.

Resume: ``paused → resuming`` → on its parked VM if it still has one (continued, the guest
told the clock); otherwise new slot and QEMU, layers written, device state loaded, the guest
told the clock and given fresh entropy → ``running``. A resume that fails before its guest
ran leaves it ``paused`` (nothing lost: the checkpoint is untouched); one whose guest ran and
then did not answer leaves it ``running`` with a 502 (its disk may have moved on).

Filesystem-only pause (E2B's ``memory: false``): the guest agent first flushes the guest's
filesystems to the disk, then the VM is stopped and only the disk is kept (no memory layer, no
device state). Resuming it cold-boots the template's kernel on that disk: processes and
memory are gone, files are there (a new ``boot_id``). ``memory: false`` on resume does the
same for a sandbox paused with its memory: its memory is dropped and its disk booted, as after
a power cut (writes the guest had not flushed are lost).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.errors import (
    GuestError,
    GuestUnresponsive,
    GuestUnresponsiveAtPause,
    SandboxStateError,
    VmmError,
)
from agentenv.orchestrator import parking
from agentenv.orchestrator.forking import (
    GUEST_BOUND_S,
    flush_guest,
    start_from_checkpoint,
)
from agentenv.orchestrator.lifecycle import State, state_error

if TYPE_CHECKING:
    from agentenv.network import Slot
    from agentenv.orchestrator.sandbox import LiveSandbox
    from agentenv.orchestrator.service import Orchestrator
    from agentenv.orchestrator.store import SandboxRecord
    from agentenv.storage import Checkpoint
    from agentenv.vmm import Machine

log = logging.getLogger(__name__)


async def pause(orch: Orchestrator, sandbox_id: str, *, memory: bool = True,
                require_healthy: bool = False, due: bool = False) -> SandboxRecord:
    """``memory=False``: filesystem-only. ``require_healthy``: refuse (503, the sandbox keeps
    running) when the guest agent does not answer, instead of saving a guest that may be hung.
    ``due``: the reaper's auto-pause, done only if the sandbox still runs past its end time
    once the lock is free (the user may have paused it, or given it more time, meanwhile)."""
    live = orch._require(sandbox_id, {State.RUNNING, State.PAUSING, State.PAUSED, State.SNAPSHOTTING,
                                      State.FORKING})
    async with live.lock:
        if due and not live.past_end():
            return live.record
        if live.record.state == State.PAUSED:
            raise SandboxStateError(sandbox_id, "paused", "running")
        if live.record.state != State.RUNNING or live.machine is None or live.envd is None:
            raise state_error(sandbox_id, live.record.state, "running", live.record.error)
        t0 = time.perf_counter()
        probe: asyncio.Future[bool] | None = None
        if not memory:
            await flush_guest(live.envd, sandbox_id)
        elif require_healthy:
            if not await live.envd.answers_within(GUEST_BOUND_S):
                raise GuestUnresponsive(f"sandbox {sandbox_id}: its guest agent does not answer, and the pause "
                                        f"asked for a healthy guest; the sandbox keeps running")
        else:
            # A memory pause of a hung agent is taken all the same, and marked: a resume with
            # that memory would bring the hung agent back (E2B's rule). The probe runs while
            # the pause is recorded and the capture gets ready, which it awaits before the VM
            # stops (a round trip on every pause otherwise: ~5 ms of 25 under TCG).
            probe = asyncio.ensure_future(live.envd.answers_within(GUEST_BOUND_S))
        machine = live.machine
        # With its VM parked, a resume soon continues that VM and does not read the memory
        # layer: a large one goes to the disk without filling the page cache (steadier pause,
        # no RAM); a small one is faster through the cache (memory_layers.capture).
        park = memory and orch.settings.pause_linger_s > 0
        try:
            await orch._transition(live, State.PAUSING)
            try:
                cp, _ = await orch.checkpoints.capture(live.record, machine, kind="pause", seal_disk=False,
                                                       keep_running=False, memory=memory, uncached=park,
                                                       guest_probe=probe)
            except BaseException as exc:
                if machine.exited:
                    await orch._fail(live, f"QEMU exited while pausing ({exc!r})")
                else:
                    await orch._revert(live, State.RUNNING)
                raise
        finally:
            if probe is not None:
                probe.cancel()  # (awaited by the capture, unless the pause failed before it)
        # Persist "paused" (with the checkpoint) before the VM is destroyed: a crash between
        # the two leaves a paused record and a stopped QEMU that recovery kills.
        try:
            await orch._transition(live, State.PAUSED, paused=cp, slot_index=None)
        except BaseException:
            await _unpause(orch, live, machine, cp)
            raise
        # The state is saved and the VM stopped: the caller is answered now. The stopped QEMU
        # is parked, or it and the network slot are freed in the background (resume and kill
        # wait for that).
        envd, slot = live.envd, live.slot
        live.machine, live.envd, live.slot = None, None, None  # the exit watcher must not see a crash
        if cp.guest_unresponsive:
            log.warning("sandbox %s: its guest agent did not answer; paused with its memory, which only a "
                        "resume without memory (a reboot) may use", sandbox_id)
            park = False  # (its memory is not resumed: the VM would wait for nothing)
        if park and envd is not None and slot is not None:
            parking.park(orch, live, machine, envd, slot)
        else:
            parking.free_later(orch, live, machine, envd, slot)
        log.info("sandbox %s: paused%s in %.1f ms", sandbox_id, "" if memory else " (filesystem only)",
                 (time.perf_counter() - t0) * 1e3)
        return live.record


async def _unpause(orch: Orchestrator, live: LiveSandbox, machine: Machine, cp: Checkpoint) -> None:
    """A pause whose record could not be written did not happen: the VM goes on from where it
    stopped (the guest lost only that moment), and the checkpoint nothing points to goes."""
    try:
        continued = False
        if not machine.exited:
            try:
                await machine.qmp("cont")
                continued = True
            except VmmError:  # its QMP broke, or it died meanwhile
                log.exception("sandbox %s: continuing its VM after a failed pause failed", live.id)
        if continued:
            await orch._revert(live, State.RUNNING)
        else:
            await orch._fail(live, "its QEMU could not be continued after the pause failed")
    finally:
        await orch.drop_checkpoint(cp.id)
        orch.schedule_gc()


async def resume(orch: Orchestrator, sandbox_id: str, timeout_s: int | None,
                 memory: bool = True) -> SandboxRecord:
    """``memory=False``: boot the sandbox's disk instead of restoring its memory (the only way
    for a filesystem-only pause, where it is the default)."""
    live = orch._require(sandbox_id, {State.PAUSED, State.RESUMING, State.RUNNING, State.PAUSING})
    async with live.lock:
        if live.record.state != State.PAUSED or live.record.paused is None:
            raise state_error(sandbox_id, live.record.state, "paused", live.record.error)
        timeout = orch.validate_timeout(orch.settings.default_timeout_s if timeout_s is None else timeout_s)
        cp = live.record.paused
        if memory and cp.guest_unresponsive and not cp.filesystem_only:
            raise GuestUnresponsiveAtPause(sandbox_id)
        orch.check_count()
        if live.parked is not None and memory and not cp.filesystem_only:
            try:
                woken = await parking.wake(orch, live, cp, timeout)
            finally:
                # Once the VM ran (even if its guest did not answer, or its QEMU then died),
                # the record no longer holds the pause: its layers are pinned by the record's
                # origin, and the manifest would only leak them.
                if live.record.paused is None:
                    await orch.drop_checkpoint(cp.id)
                    orch.schedule_gc()
            if woken is not None:
                orch._in_background(orch.checkpoints.prefetch(cp), f"reading the memory layer of {sandbox_id}")
                return woken
        parking.evict(orch, live, why="resumed without its memory")  # if it has one still
        await live.settled()
        # Counted until its VM holds its memory, as creates are, with the pages its layers
        # write into that VM's RAM: resumes at once must not each see the same free memory.
        layers_mb = sum(r.size for r in cp.memory) >> 20 if memory else 0
        async with orch.admitted(extra_mb=layers_mb, sandbox_id=live.id):
            return await _restore(orch, live, cp, timeout, memory)


async def _restore(orch: Orchestrator, live: LiveSandbox, cp: Checkpoint, timeout: int,
                   memory: bool) -> SandboxRecord:
    """The paused sandbox into a new QEMU restored from ``cp`` (its parked VM, if any, is gone)."""
    if not memory and not cp.filesystem_only:
        # Its disk is booted and written from the start: recorded without its memory before
        # that, so that no failure or crash from here on leaves a pause whose memory would be
        # restored over a disk that moved on.
        cp = cp.with_(memory=(), device=None)
    await orch._transition(live, State.RESUMING, paused=cp)
    rec = live.record
    own_disk = cp.disk_top is not None and not cp.filesystem_only
    recorded = False

    async def record_vm(slot: Slot) -> None:
        nonlocal recorded
        # Once the guest runs on its own disk there is no going back to the saved state:
        # with its slot recorded, recovery re-adopts this VM if the server dies from here on,
        # with the time to live this resume gives it (the old one may be long past: the
        # reaper would kill the re-adopted sandbox at once).
        await orch._save(live, slot_index=slot.index, end_at=time.time() + timeout, timeout_s=timeout)
        recorded = True

    try:
        # On its own disk, a guest that ran is kept even if it does not answer (see below).
        started = await start_from_checkpoint(
            orch, cp, sandbox_id=rec.id, access_token=rec.access_token, template=rec.template,
            env_vars={}, run_dir=Path(rec.run_dir), disk_top=Path(cp.disk_top) if cp.disk_top else None,
            options=rec.options, keep_if_silent=cp.disk_top is not None,
            before_run=record_vm if own_disk else None)
    except BaseException as exc:
        # Cancelled once its VM was recorded, the server stops: the VM is left ``resuming``
        # as a crash would leave it, for the next start's recovery (start_from_checkpoint).
        if not (recorded and isinstance(exc, asyncio.CancelledError)):
            await orch._revert(live, State.PAUSED, slot_index=None, end_at=rec.end_at, timeout_s=rec.timeout_s)
        raise
    live.machine, live.slot, live.envd = started.machine, started.slot, started.envd
    orch._watch(live)
    await orch._record(live, state=State.RUNNING, origin=cp, paused=None, slot_index=started.slot.index,
                       disk_path=started.disk, end_at=time.time() + timeout, timeout_s=timeout)
    # The record pins the layers now; the pause manifest is no longer needed.
    await orch.drop_checkpoint(cp.id)
    orch.schedule_gc()
    if started.silent is not None:
        # The guest ran on the sandbox's disk: back to the saved state, memory and disk
        # would no longer match. It stays running, as a resume on a parked VM does.
        if isinstance(started.silent, GuestError):
            orch.init_later(live)
        raise started.silent
    return live.record


async def connect(orch: Orchestrator, sandbox_id: str, timeout_s: int | None,
                  memory: bool = True) -> tuple[SandboxRecord, bool]:
    live = orch._require(sandbox_id, {State.RUNNING, State.PAUSED, State.PAUSING, State.RESUMING,
                                      State.SNAPSHOTTING, State.FORKING})
    async with live.lock:  # wait for a transition in progress to finish
        state = live.record.state
    if state != State.RUNNING:
        try:
            return await resume(orch, sandbox_id, timeout_s, memory), True
        except SandboxStateError:
            # Another connect (or the proxy's auto-resume) resumed it between our look and
            # our turn of the lock: connecting to a running sandbox is not an error.
            if live.record.state != State.RUNNING:
                raise
    # E2B: the time to live is only extended, by the default (300 s) when none is given.
    ttl = orch.validate_timeout(orch.settings.default_timeout_s if timeout_s is None else timeout_s)
    if time.time() + ttl > live.record.end_at:
        await orch._save(live, lambda r: r.with_(end_at=max(r.end_at, time.time() + ttl)))
    return live.record, False


async def pause_all(orch: Orchestrator) -> None:
    """Server shutdown with AENV_PAUSE_ON_STOP: pause every running sandbox (two at a time)."""
    sem = asyncio.Semaphore(2)

    async def one(sid: str) -> None:
        async with sem:
            try:
                await pause(orch, sid)
            except Exception:  # noqa: BLE001 — keep pausing the others; it stays running
                log.exception("could not pause %s at shutdown; it is left running", sid)

    running = [live.id for live in orch._live.values() if live.record.state == State.RUNNING]
    await asyncio.gather(*(one(sid) for sid in running))
