"""Start-up reconciliation: the store against what exists on the host.

QEMU processes outlive the server. On start each stored sandbox is re-adopted (its QEMU is
alive and answers QMP) or marked ``error`` with the reason; nothing is silently forgotten.
Host objects that no record owns (warm-pool shells of the previous run, namespaces, run dirs)
are removed.

A server killed in the middle of a pause, snapshot or fork leaves a record in a transitional
state. Its manifest is published last, so the repository holds either the complete new
checkpoint or none; recovery settles the sandbox on the state it can prove:

    pausing / snapshotting / forking   QEMU alive → continued, ``running`` (disk top read back
                                       from QEMU); dead → ``error``
    resuming                           QEMU alive and recorded (a parked VM being woken) →
                                       ``running``; recorded, QEMU gone (a host crash) →
                                       ``paused`` with its disk only (its guest may have run
                                       on it); not recorded (a restore cut short before its
                                       guest ran) → back to ``paused``, memory and all
    paused                             a QEMU still left (killed between the two steps, or
                                       parked: orchestrator/parking.py) is killed

Unpublished staging files, fork manifests (their children's records pin the layers) and pause
manifests no record points to are removed, then unreferenced layers are collected.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.envd_client import EnvdClient
from agentenv.errors import NetworkError, StorageError, VmmError
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.storage import backing_chain, remove_tree
from agentenv.vmm import Machine, find_qemu_pids, kill_pid
from agentenv.vmm.spec import spec_from_json

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)


async def recover(orch: Orchestrator) -> None:
    records = await orch.store.all()
    owned: set[str] = set()
    for rec in records:
        owned.add(rec.id)
        live = LiveSandbox(rec)
        orch._live[rec.id] = live
        if rec.state == State.ERROR:
            if rec.slot_index is not None:  # kept by a failure that could not free it: a kill does
                orch.slots.mark_used(rec.slot_index)
                live.slot = orch.slots.slot(rec.slot_index)
            continue
        if rec.state == State.KILLING:
            await _kill_leftover(Path(rec.run_dir))
            if rec.slot_index is not None:
                await orch.slots.release(orch.slots.slot(rec.slot_index))
            orch._live.pop(rec.id)
            await orch.store.delete(rec.id)
            await remove_tree(Path(rec.run_dir))
            continue
        if rec.state == State.PAUSED:
            await _kill_leftover(Path(rec.run_dir))
            continue
        if rec.state == State.RESUMING and rec.slot_index is None and rec.paused is not None:
            # a restore cut short before its VM was recorded: the saved state stands
            await _kill_leftover(Path(rec.run_dir))
            live.record = rec.with_(state=State.PAUSED)
            await orch.store.put(live.record)
            log.warning("sandbox %s: resume interrupted before its VM ran; it is paused", rec.id)
            continue
        if rec.slot_index is not None:
            orch.slots.mark_used(rec.slot_index)
            live.slot = orch.slots.slot(rec.slot_index)
        try:
            spec = spec_from_json(json.loads((Path(rec.run_dir) / "machine.json").read_text()))
            if rec.disk_path:  # the top it writes to now (a snapshot switches it; machine.json keeps the first)
                spec = replace(spec, disk=Path(rec.disk_path))
            live.machine = await Machine.adopt(spec)
        except (OSError, ValueError, VmmError) as exc:
            if rec.state == State.RESUMING and rec.paused is not None:
                # Its VM was recorded, so it may have run on the sandbox's own disk before it
                # was lost (a host crash): the saved memory no longer matches that disk. Its
                # files are kept and its memory dropped: a resume boots its disk, as after a
                # power cut (orchestrator/pausing.py, ``memory: false``).
                if live.slot is not None:
                    await orch.slots.release(live.slot)
                    live.slot = None
                live.record = rec.with_(state=State.PAUSED, slot_index=None,
                                        paused=rec.paused.with_(memory=(), device=None))
                await orch.store.put(live.record)
                log.warning("sandbox %s: its VM was lost while it was being resumed; it is paused with its "
                            "files, without its memory (a resume boots its disk)", rec.id)
                continue
            why = "its machine record is unreadable" if isinstance(exc, ValueError) else "QEMU was gone"
            await orch._fail(live, f"{why} when the server restarted ({exc})")
            continue
        assert live.slot is not None
        live.envd = EnvdClient.for_guest(live.slot.guest_url, rec.access_token)
        if rec.state != State.RUNNING:
            await _settle(orch, live)
        elif not await _runs(orch, live, "its VM could not be continued when the server restarted"):
            continue
        try:  # the record's egress rules, whatever a change cut short left in the namespace
            await orch._apply_egress(live)
        except NetworkError as exc:
            log.error("sandbox %s: its egress rules could not be put back: %s", rec.id, exc.message)
        orch._watch(live)
        log.info("re-adopted sandbox %s (pid %d)", rec.id, live.machine.pid)
    # Leftovers that no record owns: previous warm-pool shells, half-made sandboxes.
    if orch.sandboxes_dir.exists():
        for d in orch.sandboxes_dir.iterdir():
            if d.name not in owned:
                await _kill_leftover(d)
                await remove_tree(d)
    # QEMU processes of this node that nothing adopted (a launch or a template boot cut short by
    # a crash or a stop, or the machine of a sandbox that just failed re-adoption): sandboxes'
    # and templates' alike live under the data dir.
    adopted = {sid for sid, live in orch._live.items() if live.machine is not None}
    for pid, name in find_qemu_pids(str(orch.settings.data_dir) + "/").items():
        if name not in adopted:
            log.warning("killing QEMU %d (%s) that no sandbox owns", pid, name)
            kill_pid(pid)
    referenced = {r.record.paused.id for r in orch._live.values() if r.record.paused is not None}
    for cp in orch.repo.list():
        if cp.kind == "fork" or (cp.kind == "pause" and cp.id not in referenced):
            log.info("removing %s manifest %s left by an interrupted operation", cp.kind, cp.id)
            orch.repo.delete(cp.id)
    for name in await asyncio.to_thread(orch.repo.remove_torn):
        log.warning("removed manifest %s: empty, torn by a host crash before it reached the disk", name)
    await orch.gc(staging_older_than=0)
    await orch.snapshots.remove_stale(orch.catalog, orch.template_snapshots_in_use)
    keep = {r.record.slot_index for r in orch._live.values() if r.record.slot_index is not None}
    removed = await orch.slots.remove_orphans({k for k in keep if k is not None})
    if removed:
        log.info("removed %d orphaned network namespaces", len(removed))


async def _runs(orch: Orchestrator, live: LiveSandbox, why: str) -> bool:
    """Its VM runs: one stopped for an operation that a stop or crash cut short before it
    continued the VM again (a pause's capture) is continued; its guest would otherwise never
    answer. False: it could not be, and the sandbox failed (``why``)."""
    assert live.machine is not None
    try:
        if await live.machine.status() in ("paused", "postmigrate"):
            log.warning("sandbox %s: its VM is stopped; continuing it", live.id)
            await live.machine.qmp("cont")
    except VmmError as exc:
        await orch._fail(live, f"{why}: {exc}")
        return False
    return True


async def _settle(orch: Orchestrator, live: LiveSandbox) -> None:
    """A live QEMU whose sandbox was mid-operation: make it run, record its real disk top."""
    assert live.machine is not None
    rec = live.record
    why = f"could not continue after an interrupted {rec.state.value}"
    if not await _runs(orch, live, why):
        return
    try:
        top = await live.machine.disk_top()
    except VmmError as exc:
        await orch._fail(live, f"{why}: {exc}")
        return
    # The machine too: it was adopted with the record's top, which a snapshot cut short after
    # its seal has left behind (removed); the gc's pins and the next checkpoint read the spec.
    live.machine.spec = replace(live.machine.spec, disk=top)
    await asyncio.to_thread(_remove_unused_tops, Path(rec.run_dir), top)
    changes: dict[str, object] = {"state": State.RUNNING, "disk_path": str(top)}
    if rec.state == State.RESUMING and rec.paused is not None:
        changes.update(origin=rec.paused, paused=None)
    log.warning("sandbox %s: %s was interrupted by a restart; it is running", rec.id, rec.state.value)
    live.record = rec.with_(**changes)
    await orch.store.put(live.record)
    if rec.state == State.RESUMING and live.envd is not None:
        try:  # the clock and entropy the interrupted resume may not have given it
            await live.reidentify(live.envd, orch.settings.restore_timeout_s)
        except Exception:  # noqa: BLE001 — best effort; the sandbox runs either way
            log.warning("sandbox %s: could not refresh its clock after the interrupted resume", rec.id)


def _remove_unused_tops(run_dir: Path, top: Path) -> None:
    """A checkpoint cut short leaves overlays in the run dir that the VM does not write to:
    the new top it created before switching the disk to it, or the sealed top it had not yet
    unlinked (its repository link stays, for the gc to judge)."""
    try:
        keep = {p.resolve() for p in (top, *backing_chain(top))}
    except StorageError as exc:  # keep them all: the next start tries again
        log.warning("overlays of %s kept: %s", run_dir.name, exc.message)
        return
    for path in run_dir.glob("disk*.qcow2"):
        if path.resolve() not in keep:
            log.info("removing overlay %s left by an interrupted checkpoint", path.name)
            path.unlink(missing_ok=True)


async def _kill_leftover(run_dir: Path) -> None:
    """Kill the QEMU of a run dir if it is still running."""
    try:
        spec = spec_from_json(json.loads((run_dir / "machine.json").read_text()))
        machine = await Machine.adopt(spec)
    except (OSError, ValueError, VmmError):
        return
    await machine.kill()
