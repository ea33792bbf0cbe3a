"""Named snapshots, fork, and starting sandboxes from saved states.

Snapshot: ``running → snapshotting`` → checkpoint with the disk sealed (the sandbox goes on
writing into a new overlay) → manifest published → ``running``. The snapshot outlives its
source and a restart; ``create`` accepts its id or name in place of a template.

Fork: ``running → forking`` → one checkpoint (disk sealed) → ``running`` → N children started
concurrently from it. Each child gets a new id and token, its own network slot (same guest
address), fresh entropy and the clock, and inherits memory, disk, env vars, metadata,
auto-pause and the timeout length. Children map the same template memory file and read the
same layers, so the host page cache holds them once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.envd_client import EnvdClient, EnvdError
from agentenv.errors import (
    GuestError,
    GuestUnresponsive,
    InvalidRequest,
    PlatformError,
    VmmError,
)
from agentenv.network import Slot, set_egress
from agentenv.orchestrator import parking
from agentenv.orchestrator.cleanup import Cleanup
from agentenv.orchestrator.idempotency import OPTION as IDEMPOTENCY
from agentenv.orchestrator.ids import new_access_token, new_sandbox_id
from agentenv.orchestrator.lifecycle import State, state_error
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.orchestrator.store import SandboxRecord
from agentenv.storage import Checkpoint, remove_tree
from agentenv.vmm import Machine

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator
    from agentenv.orchestrator.snapshot_shells import SnapshotShell

log = logging.getLogger(__name__)

# From this many children on, a fork writes one memory file with the checkpoint's pages that
# every child maps (shared page cache, no per-child page copy) instead of copying the pages
# into each child's RAM; the file is removed when no sandbox maps it any more.
MATERIALIZE_FROM = 2

SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")

# How long a pause or snapshot waits for the guest agent when it needs it (to flush the
# guest's filesystems, or to check that the guest is healthy).
GUEST_BOUND_S = 10.0


@dataclass
class Started:
    machine: Machine
    slot: Slot
    envd: EnvdClient
    disk: str
    silent: PlatformError | None = None  # (keep_if_silent) the guest ran, and did not answer


async def start_from_checkpoint(orch: Orchestrator, cp: Checkpoint, *, sandbox_id: str, access_token: str,
                                template: str, env_vars: dict[str, str], run_dir: Path,
                                disk_top: Path | None = None, options: dict[str, Any] | None = None,
                                mem_file: Path | None = None, keep_if_silent: bool = False, nice: int = 0,
                                before_run: Callable[[Slot], Awaitable[None]] | None = None) -> Started:
    """Slot (with the sandbox's egress rules) + QEMU restored to ``cp`` + the guest's identity
    (id, token, fresh entropy, the clock). Undoes everything it made on failure; never
    touches the checkpoint. ``keep_if_silent`` (a resume on the sandbox's own disk): a guest
    that ran but did not answer is kept, with the error in ``Started.silent`` (a VmmError if
    its QEMU died meanwhile); its disk may have moved on, so going back to the saved state
    would no longer be exact. ``before_run(slot)``: awaited before the restored guest runs.
    ``nice``: the CPU priority of a VM made ahead of time (vmm/priority.py)."""
    undo = Cleanup(f"start {sandbox_id}")
    t0 = time.perf_counter()
    recorded = False
    machine: Machine | None = None
    envd: EnvdClient | None = None

    async def record(slot: Slot) -> None:
        nonlocal recorded
        assert before_run is not None
        await before_run(slot)
        recorded = True

    try:
        slot = await orch.slots.acquire()
        undo.add("slot", lambda: orch.slots.release(slot))
        await _egress_policy(slot, options)  # before the guest runs an instruction
        t1 = time.perf_counter()
        machine, disk = await orch.checkpoints.restore(cp, name=sandbox_id, run_dir=run_dir, slot=slot,
                                                       disk_top=disk_top, mem_file=mem_file,
                                                       verified=mem_file is not None, nice=nice,
                                                       before_run=(lambda: record(slot)) if before_run else None)
        undo.add("machine", machine.kill)
        await orch.checkpoints.crash_point("start_after_restore")
        if keep_if_silent and "hang_after_resume" in orch.settings.faults:
            # Injected fault (tests): a guest that answers only after the restore timeout.
            await machine.qmp("stop")
            asyncio.get_running_loop().call_later(orch.settings.restore_timeout_s + 2,
                                                  lambda: asyncio.ensure_future(_cont_quietly(machine)))
        envd = EnvdClient.for_guest(slot.guest_url, cp.access_token)
        undo.add("envd", envd.aclose)
        t2 = time.perf_counter()
        timeout = orch.settings.restore_timeout_s
        try:
            if cp.filesystem_only:  # a cold boot: a fresh agent, given back what it held
                timeout = orch.settings.boot_timeout_s
                await envd.wait_healthy(timeout)
                await asyncio.wait_for(envd.init(
                    sandbox_id=sandbox_id, template_id=template, env_vars={**cp.env_vars, **env_vars},
                    access_token=access_token, default_user=cp.default_user,
                    default_workdir=cp.default_workdir), orch.settings.restore_timeout_s)
            else:
                await asyncio.wait_for(envd.init(sandbox_id=sandbox_id, template_id=template, env_vars=env_vars,
                                                 access_token=access_token), timeout)
        except (EnvdError, asyncio.TimeoutError) as exc:
            why = exc.message if isinstance(exc, EnvdError) else "no answer"
            after = "its boot" if cp.filesystem_only else "restore"
            if keep_if_silent:  # the guest ran: its disk may have moved on since the saved state
                undo.release()
                silent: PlatformError = GuestError(
                    f"sandbox {sandbox_id} runs again, but its guest agent did not answer within {timeout:.0f}s "
                    f"after {after} ({why}); retry, or kill it")
                if not machine.alive():  # the caller's exit watcher makes the sandbox error
                    silent = VmmError(f"sandbox {sandbox_id}: its QEMU exited while it was resumed")
                return Started(machine, slot, envd, disk, silent=silent)
            raise GuestError(f"sandbox {sandbox_id}: the guest agent did not answer within {timeout:.0f}s "
                             f"after {after} ({why})") from exc
        undo.release()
        log.info("started %s from checkpoint %s: slot %.1f ms, restore %.1f ms, guest init %.1f ms", sandbox_id,
                 cp.id, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3)
        return Started(machine, slot, envd, disk)
    except BaseException as exc:
        if recorded and isinstance(exc, asyncio.CancelledError):
            # The server stops (it cancels the requests still running after its grace period)
            # once the caller recorded this VM with its slot: the guest may have run on the
            # sandbox's disk, so the saved state is no longer exact. Leave VM and slot as a
            # crash here would; the next start's recovery continues the VM (recovery.py).
            # (Cancelled inside the restore, the restore has left its VM so already.)
            undo.release()
            if envd is not None:
                await envd.aclose()
            if machine is not None:
                await machine.detach()
        else:
            await undo.unwind()
        raise


async def _egress_policy(slot: Slot, options: dict[str, Any] | None) -> None:
    """The create's egress rules, if it has any (a new slot allows everything else)."""
    net = (options or {}).get("network") or {}
    if net.get("allowOut") or net.get("denyOut"):
        await set_egress(slot, net.get("allowOut", []), net.get("denyOut", []))


async def _cont_quietly(machine: Machine) -> None:
    try:
        await machine.qmp("cont")
    except Exception:  # noqa: BLE001 — the VM may be gone by then
        pass


async def _new_sandbox(orch: Orchestrator, cp: Checkpoint, *, template: str, env_vars: dict[str, str],
                       metadata: dict[str, str], timeout_s: int, options: dict[str, Any],
                       mem_file: Path | None = None) -> SandboxRecord:
    """A new sandbox (new id, token, slot) from a checkpoint; registered once it answers."""
    sandbox_id = new_sandbox_id()
    token = new_access_token()
    run_dir = orch.sandboxes_dir / sandbox_id
    try:
        started = await start_from_checkpoint(orch, cp, sandbox_id=sandbox_id, access_token=token,
                                              template=template, env_vars=env_vars, run_dir=run_dir,
                                              options=options, mem_file=mem_file)
    except BaseException:
        await remove_tree(run_dir)
        raise
    return await _register(orch, cp, started, sandbox_id, token, run_dir, template=template, env_vars=env_vars,
                           metadata=metadata, timeout_s=timeout_s, options=options)


async def _register(orch: Orchestrator, cp: Checkpoint, started: Started, sandbox_id: str, token: str,
                    run_dir: Path, *, template: str, env_vars: dict[str, str], metadata: dict[str, str],
                    timeout_s: int, options: dict[str, Any]) -> SandboxRecord:
    """Record a sandbox whose guest answers and watch it; one that cannot be recorded is destroyed."""
    now = time.time()
    rec = SandboxRecord(
        id=sandbox_id, template=template, state=State.RUNNING, vcpus=cp.vcpus, memory_mb=cp.memory_mb,
        disk_mb=cp.disk_mb, started_at=now, end_at=now + timeout_s, access_token=token, run_dir=str(run_dir),
        metadata=dict(metadata), env_vars={**cp.env_vars, **env_vars}, slot_index=started.slot.index,
        base_dir=cp.base, disk_path=started.disk, origin=cp, auto_pause=bool(options.get("autoPause")),
        timeout_s=timeout_s, options=options,
    )
    try:
        await orch.store.put(rec)
    except BaseException:
        # Not recorded (a full disk under the store, or the server stopping): the child is
        # not made, and nothing of it may run on unlisted and unwatched.
        await _discard(orch, started, run_dir, rec.id)
        raise
    live = LiveSandbox(rec, started.machine, started.slot, started.envd)
    orch._live[rec.id] = live
    orch._watch(live)
    return rec


async def _discard(orch: Orchestrator, started: Started, run_dir: Path, sandbox_id: str) -> None:
    undo = Cleanup(f"unrecorded sandbox {sandbox_id}")
    undo.add("run dir", lambda: remove_tree(run_dir))
    undo.add("vm", lambda: parking.free(orch, started.machine, started.envd, started.slot))
    undo.add("record", lambda: orch.store.delete(sandbox_id))  # if the put landed after all
    await undo.unwind()


def _child_options(options: dict[str, Any], idempotency: dict[str, str] | None) -> dict[str, Any]:
    """A child keeps the source's network policy and lifecycle options; a private sandbox's
    traffic token is its own, and the create's Idempotency-Key stays with the source: a child
    records the fork's key, if it has one."""
    out = dict(options)
    out.pop(IDEMPOTENCY, None)
    if idempotency:
        out[IDEMPOTENCY] = idempotency
    if "trafficAccessToken" in out:
        out["trafficAccessToken"] = new_access_token()
    return out


async def create_from_snapshot(orch: Orchestrator, id_or_name: str, *, timeout_s: int | None,
                               metadata: dict[str, str] | None, env_vars: dict[str, str] | None,
                               options: dict[str, Any]) -> SandboxRecord:
    cp = orch.repo.get(id_or_name)
    if cp.kind not in ("snapshot", "template"):
        raise InvalidRequest(f"'{id_or_name}' is not a snapshot or a template")
    timeout = orch.validate_timeout(orch.settings.default_timeout_s if timeout_s is None else timeout_s)
    template, env, meta = cp.name or cp.id, dict(env_vars or {}), {**cp.metadata, **(metadata or {})}
    orch.check_count()
    with orch.snapshot_shells.starting(cp) as shell:
        if shell is not None:  # its VM holds its memory already: counted, not admitted by memory again
            with orch.counting(), orch.pinning(cp):
                rec = await _from_shell(orch, cp, shell, template=template, env_vars=env, metadata=meta,
                                        timeout_s=timeout, options=options)
            if rec is not None:
                return rec
        async with orch.admitted(starting=cp):
            return await _new_sandbox(orch, cp, template=template, env_vars=env, metadata=meta,
                                      timeout_s=timeout, options=options)


async def _from_shell(orch: Orchestrator, cp: Checkpoint, shell: SnapshotShell, *, template: str,
                      env_vars: dict[str, str], metadata: dict[str, str], timeout_s: int,
                      options: dict[str, Any]) -> SandboxRecord | None:
    """A sandbox from a primed shell of ``cp`` (orchestrator/snapshot_shells.py): its policy,
    then ``cont`` and the clock and env vars. None (the shell destroyed) when its guest does
    not answer: the caller starts one the usual way instead."""
    started = shell.started
    try:
        await _egress_policy(started.slot, options)  # before the guest runs again
        started.machine.foreground()  # made in the background: now a live sandbox
        await started.machine.qmp("cont")
        # The name it was primed under may have gone to a newer snapshot since (a name moves
        # to the newest snapshot given it): the guest's E2B_TEMPLATE_ID follows the record's.
        await asyncio.wait_for(started.envd.resume(env_vars, template_id=template), orch.settings.restore_timeout_s)
    except (EnvdError, VmmError, asyncio.TimeoutError) as exc:
        log.warning("ready shell %s of snapshot %s did not come up (%r); starting a new one instead",
                    shell.sandbox_id, cp.id, exc)
        orch.snapshot_shells.discard(shell)
        return None
    except BaseException:
        orch.snapshot_shells.discard(shell)
        raise
    return await _register(orch, cp, started, shell.sandbox_id, shell.access_token, shell.run_dir,
                           template=template, env_vars=env_vars, metadata=metadata, timeout_s=timeout_s,
                           options=options)


async def flush_guest(envd: EnvdClient, sandbox_id: str) -> None:
    """The guest writes its dirty pages to its disk: a filesystem-only checkpoint keeps only that."""
    try:
        await envd.sync(timeout=GUEST_BOUND_S)
    except EnvdError as exc:
        raise GuestUnresponsive(
            f"sandbox {sandbox_id}: saving only its filesystem needs the guest agent to flush the guest's "
            f"filesystems, and it did not ({exc.message}); the sandbox keeps running") from exc


async def _checkpoint(orch: Orchestrator, live: LiveSandbox, state: State, kind: str,
                      name: str | None, memory: bool = True) -> Checkpoint:
    """One checkpoint of a running sandbox, disk sealed; the sandbox keeps running."""
    async with live.lock:
        if live.record.state != State.RUNNING or live.machine is None or live.envd is None:
            raise state_error(live.id, live.record.state, "running", live.record.error)
        if not memory:
            await flush_guest(live.envd, live.id)
        await orch._transition(live, state)
        machine = live.machine
        try:
            cp, _ = await orch.checkpoints.capture(live.record, machine, kind=kind, name=name, seal_disk=True,
                                                   keep_running=True, memory=memory)
        except BaseException as exc:
            if machine.exited:
                await orch._record(live, disk_path=str(machine.spec.disk))
                await orch._fail(live, f"QEMU exited during a {kind} ({exc!r})")
            else:
                await orch._revert(live, State.RUNNING, disk_path=str(machine.spec.disk))
            raise
        if "qemu_dies_after_capture" in orch.settings.faults:  # injected fault (tests)
            os.kill(machine.pid, signal.SIGKILL)  # as the OOM killer would, right after the capture
            await machine.wait_exit()
        await orch._record(live, disk_path=str(machine.spec.disk), state=State.RUNNING)
        orch.notice_exit(live)
        return cp


async def snapshot(orch: Orchestrator, sandbox_id: str, name: str | None, memory: bool = True) -> Checkpoint:
    """``memory=False``: the filesystem only (sandboxes started from it boot its disk)."""
    if name is not None:
        if not SNAPSHOT_NAME.fullmatch(name):
            raise InvalidRequest("snapshot name must be 1-64 letters, digits, '-' or '_', starting with a "
                                 "letter or digit")
        if orch.catalog.exists(name) or orch.builds.exists(name):
            raise InvalidRequest(f"the name '{name}' is a template's; choose another snapshot name")
    live = orch._require(sandbox_id, {State.RUNNING, State.SNAPSHOTTING, State.FORKING})
    cp = await _checkpoint(orch, live, State.SNAPSHOTTING, "snapshot", name, memory)
    if name is not None:
        # E2B semantics: a name already taken moves to the new snapshot (a new build of the
        # same snapshot template); the older snapshot keeps its id and stays usable by id.
        # Under the repository lock, read afresh: a snapshot deleted meanwhile is not written
        # back, and of two snapshots given the name at once the newer keeps it.
        async with orch.repo.lock:
            for older in orch.repo.list("snapshot"):
                if older.name == name and older.id != cp.id and (older.created_at, older.id) < (cp.created_at, cp.id):
                    await asyncio.to_thread(orch.repo.put, older.with_(name=None))
    return cp


async def fork(orch: Orchestrator, sandbox_id: str, count: int, timeout_s: int | None,
               idempotency: dict[str, str] | None = None) -> list[SandboxRecord | Exception]:
    limit = orch.settings.max_fork
    if not 1 <= count <= limit:
        raise InvalidRequest(f"count must be between 1 and {limit}, got {count}")
    live = orch._require(sandbox_id, {State.RUNNING, State.SNAPSHOTTING, State.FORKING})
    if timeout_s is not None:
        orch.validate_timeout(timeout_s)
    async with orch.admitted(count):  # (each child counts twice once started: until they all are)
        t0 = time.perf_counter()
        cp = await _checkpoint(orch, live, State.FORKING, "fork", None)
        src = live.record
        timeout = src.timeout_s if timeout_s is None else timeout_s
        t1 = time.perf_counter()
        fork_mem = orch.settings.mem_dir / f"fork-{cp.id}.mem"
        try:
            with orch.claiming(fork_mem):  # from before it is written until the children are listed
                mem_file = None
                if count >= MATERIALIZE_FROM:
                    mem_file = await orch.checkpoints.materialize(cp, fork_mem)
                results = await asyncio.gather(  # (options per child: each its own traffic token)
                    *(_new_sandbox(orch, cp, template=src.template, env_vars={}, metadata=src.metadata,
                                   timeout_s=timeout, options=_child_options(src.options, idempotency),
                                   mem_file=mem_file)
                      for _ in range(count)),
                    return_exceptions=True)
        finally:
            # The children's records pin the layers; the fork manifest itself is not kept.
            await orch.drop_checkpoint(cp.id)
            orch.schedule_gc()
    out: list[SandboxRecord | Exception] = []
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r
        out.append(r)
    ok = sum(1 for r in out if isinstance(r, SandboxRecord))
    log.info("fork of %s: checkpoint %.1f ms, %d/%d children in %.1f ms", sandbox_id, (t1 - t0) * 1e3, ok,
             count, (time.perf_counter() - t1) * 1e3)
    return out
