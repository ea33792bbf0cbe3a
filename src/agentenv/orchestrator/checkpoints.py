"""Saving a running sandbox's state and starting machines from saved states.

``capture`` is one stop window of the source VM (qemu-microvm-notes.md §8–9)::

    stop → [seal the disk: the top overlay becomes a repository layer, a new empty overlay
            becomes the top, live, via blockdev-snapshot]
         → memory layer (the pages changed since the chain it was restored from)
         → device state → import both into the repository → publish the manifest → cont

The manifest is written last and atomically, so a crash anywhere before it leaves no visible
checkpoint, and the staged files are removed by the next start. A failure (e.g. a full disk)
continues the VM: the source keeps running and the caller gets the error.

``restore`` starts a QEMU mapping the template's memory file copy-on-write, writes the
chain's pages into it, then loads the device state. The caller gives the guest its identity.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from agentenv.errors import DiskFull, SnapshotUnusable, VmmError
from agentenv.network import Slot
from agentenv.orchestrator.cleanup import Cleanup
from agentenv.orchestrator.store import SandboxRecord
from agentenv.orchestrator.templates import TemplateCatalog, guest_link_spec
from agentenv.storage import (
    Checkpoint,
    LayerRef,
    SnapshotRepository,
    TemplateSnapshot,
    backing_chain,
    create_overlay,
    create_overlay_over,
    new_checkpoint_id,
)
from agentenv.storage import memory_layers as ml
from agentenv.vmm import AccelInfo, Machine, MachineSpec
from agentenv.vmm.spec import spec_to_json

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, repo: SnapshotRepository, *, catalog: TemplateCatalog, sock_dir: Path, accel: AccelInfo,
                 tb_size_mb: int, restore_timeout_s: float, max_memory_layers: int, faults: frozenset[str],
                 max_disk_layers: int = 16, guest_aslr: bool = False) -> None:
        self.guest_aslr = guest_aslr
        self.catalog = catalog
        self.max_disk_layers = max_disk_layers
        self.repo = repo
        self.sock_dir = sock_dir
        self.accel = accel
        self.tb_size_mb = tb_size_mb
        self.restore_timeout_s = restore_timeout_s
        self.max_memory_layers = max_memory_layers
        self.faults = faults
        self._background: set[asyncio.Task[None]] = set()

    async def crash_point(self, name: str) -> None:
        """Tests name crash points in AENV_FAULTS; the server then stops here (hangs) so that
        the test can SIGKILL it at exactly this step."""
        if name in self.faults:
            log.warning("crash point %s reached: waiting to be killed", name)
            await asyncio.sleep(3600)

    # -- capture --------------------------------------------------------------------------

    async def capture(self, rec: SandboxRecord, machine: Machine, *, kind: str, name: str | None = None,
                      seal_disk: bool, keep_running: bool, memory: bool = True,
                      uncached: bool = False,
                      guest_probe: Awaitable[bool] | None = None) -> tuple[Checkpoint, str]:
        """Checkpoint the sandbox; returns the published checkpoint and the disk overlay the
        sandbox writes to from now on (a new one if the disk was sealed). ``memory=False``: a
        filesystem-only checkpoint (the caller had the guest flush its filesystems first).
        ``uncached``: the memory layer is not read soon (``memory_layers.capture``).
        ``guest_probe``: whether the guest agent answers, awaited before the VM stops (and
        before the repository lock: a hung agent takes the probe's whole bound); recorded as
        ``Checkpoint.guest_unresponsive``."""
        await asyncio.to_thread(self.repo.ensure_room)
        await machine.wait_jobs()  # a disk being streamed is not sealed
        guest_unresponsive = guest_probe is not None and not await guest_probe
        env, user, workdir = self._guest_defaults(rec)
        undo = Cleanup(f"checkpoint of {rec.id}")
        disk_top = rec.disk_path
        completed = False
        try:
            async with self.repo.lock:  # first: the guest runs on while another capture or a gc holds it
                t0 = time.perf_counter()
                await machine.qmp("stop")
                if seal_disk:
                    sealed = await asyncio.to_thread(self.repo.link_disk, Path(rec.disk_path))
                    sealed_path = self.repo.layer_path(sealed.name)
                    undo.add("sealed", lambda: asyncio.to_thread(sealed_path.unlink, True))
                    new_top = Path(rec.run_dir) / f"disk-{sealed.name[5:21]}.qcow2"
                    await create_overlay_over(new_top, sealed_path, rec.disk_mb)
                    undo.add("overlay", lambda: asyncio.to_thread(new_top.unlink, True))
                    await self.crash_point(f"{kind}_before_switch")
                    await machine.switch_disk(new_top)
                    undo.release()  # the VM now writes to new_top: the sealed layer is in use
                    # In memory only: the sandbox's record holds the current top (recovery
                    # adopts the machine with it). Rewriting machine.json over itself here made
                    # ext4 flush it behind all pending write-back: 0.7 s after a 1 GiB write.
                    machine.spec = replace(machine.spec, disk=new_top)
                    # the run dir's name for the sealed layer is not needed (QEMU has it open,
                    # the new top names the repository's link): keep one link, the GC's
                    Path(rec.disk_path).unlink(missing_ok=True)
                    disk_top = str(new_top)
                disk_layers = await asyncio.to_thread(self._disk_layers, Path(disk_top))
                await self.crash_point(f"{kind}_after_disk")
                t1 = time.perf_counter()
                if memory:
                    pages, mem_layers, dev_ref = await self._capture_memory(rec, machine, kind, undo, uncached)
                else:
                    pages, mem_layers, dev_ref = 0, (), None
                    await self.crash_point(f"{kind}_before_publish")
                t2 = time.perf_counter()
                cp = Checkpoint(
                    id=new_checkpoint_id(), kind=kind, name=name, template=rec.template, base=rec.base_dir,
                    base_created_at=_base(rec.base_dir).created_at, vcpus=rec.vcpus, memory_mb=rec.memory_mb,
                    disk_mb=rec.disk_mb, memory=mem_layers, device=dev_ref, disk=disk_layers,
                    disk_top=None if seal_disk else rec.disk_path, source_sandbox=rec.id,
                    env_vars=env, metadata=rec.metadata, access_token=rec.access_token,
                    created_at=time.time(), default_user=user, default_workdir=workdir,
                    guest_unresponsive=guest_unresponsive,
                )
                t3 = time.perf_counter()
                # Atomic (visible whole or not at all, across a server crash); durable against a
                # host crash once its layers are, after the stop window (below).
                await asyncio.to_thread(self.repo.put, cp, False)
                t4 = time.perf_counter()
                await self.crash_point(f"{kind}_after_publish")
                undo.release()
                completed = True
            if kind == "snapshot":  # named snapshots outlive the host's page cache: write them back
                task = asyncio.get_running_loop().create_task(asyncio.to_thread(self.repo.make_durable, cp))
                self._background = {t for t in self._background if not t.done()} | {task}
            if seal_disk and len(disk_layers) > self.max_disk_layers:
                # Bound the chain: stream the layers into the new top, in QEMU, while the guest
                # runs; the checkpoint just taken keeps its own layers through its manifest.
                # Best effort: the checkpoint is published, and the next one tries again (a
                # QEMU that died meanwhile is the exit watcher's).
                try:
                    await machine.stream_disk(_base(rec.base_dir).disk)
                    log.info("%s: disk chain of %d layers is being streamed into its top", rec.id,
                             len(disk_layers))
                except VmmError as exc:
                    log.warning("%s: its disk chain of %d layers could not be streamed (%s); the next "
                                "checkpoint tries again", rec.id, len(disk_layers), exc.message)
            log.info("%s of %s: %s, VM stopped %.1f ms (before memory %.1f, memory+device %.1f, "
                     "manifest %.1f)", kind, rec.id, f"{pages} pages" if memory else "filesystem only",
                     (time.perf_counter() - t0) * 1e3,
                     (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t4 - t3) * 1e3)
            return cp, disk_top
        except BaseException:
            await undo.unwind()
            raise
        finally:
            if keep_running or not completed:
                try:
                    await machine.qmp("cont")
                except VmmError:
                    log.exception("could not continue %s after its checkpoint", rec.id)

    def _guest_defaults(self, rec: SandboxRecord) -> tuple[dict[str, str], str | None, str | None]:
        """The env vars, default user and workdir the sandbox's agent holds, as the host knows
        them: what its origin checkpoint recorded, or its catalog template's (a sandbox from the
        warm pool has no origin). A cold boot from the checkpoint gives them back to the agent."""
        if rec.origin is not None:
            return rec.env_vars, rec.origin.default_user, rec.origin.default_workdir
        t = self.catalog.get(rec.template) if self.catalog.exists(rec.template) else None
        if t is None:
            return rec.env_vars, None, None
        return {**t.env, **rec.env_vars}, t.user, t.workdir

    async def _capture_memory(self, rec: SandboxRecord, machine: Machine, kind: str, undo: Cleanup,
                              uncached: bool) -> tuple[int, tuple[LayerRef, ...], LayerRef]:
        """The memory layer (pages changed since the chain the sandbox was restored from) and
        the device state, imported into the repository; returns the new chain."""
        chain = [self.repo.layer_path(r.name) for r in (rec.origin.memory if rec.origin else ())]
        mem_tmp = self.repo.staging_path("mem")
        undo.add("mem", lambda: asyncio.to_thread(mem_tmp.unlink, True))
        dev_tmp = self.repo.staging_path("dev")
        undo.add("dev", lambda: asyncio.to_thread(dev_tmp.unlink, True))
        # The VM is stopped: QEMU writes its device state while a thread of ours copies its
        # changed pages out (process_vm_readv) on the other core.
        t0 = time.perf_counter()
        copy = asyncio.ensure_future(asyncio.to_thread(
            ml.capture, machine.pid, machine.spec.mem_path, mem_tmp, chain, uncached=uncached,
            spares=self.repo.spares))
        try:
            device_failed: VmmError | None = None
            try:
                await machine.save_device_state(dev_tmp)
            except VmmError as exc:
                device_failed = exc
            t_device = (time.perf_counter() - t0) * 1e3
            info = await asyncio.shield(copy)
            t_memory = (time.perf_counter() - t0) * 1e3
        except BaseException:
            # Whatever ends this (the copy's own failure, a cancellation), the copy thread is
            # waited for: it must not write after the undo removed its file, nor read the VM
            # after it runs again.
            await asyncio.wait([copy])
            raise
        if device_failed is not None:
            # Most likely a full disk that the copy made room on (it gives the spare files'
            # space back and retries): once more, alone, with the disk checked first.
            log.warning("%s of %s: the device state failed (%s); trying once more", kind, rec.id,
                        device_failed.message)
            await asyncio.to_thread(self.repo.ensure_room)
            await machine.save_device_state(dev_tmp)
        dev_digest = await asyncio.to_thread(ml.whole_file_digest, dev_tmp)
        log.info("%s of %s: memory %.1f ms, device state %.1f ms (at once), then its digest %.1f ms", kind,
                 rec.id, t_memory, t_device, (time.perf_counter() - t0) * 1e3 - max(t_memory, t_device))
        await self.crash_point(f"{kind}_before_publish")
        mem_ref = await asyncio.to_thread(self.repo.import_layer, mem_tmp, "mem", info.digest)
        dev_ref = await asyncio.to_thread(self.repo.import_layer, dev_tmp, "dev", dev_digest)
        memory = (*(rec.origin.memory if rec.origin else ()), mem_ref)
        if len(memory) > self.max_memory_layers:
            try:
                memory = (await self._compact(memory),)
            except ml.CorruptLayer as exc:
                # The VM's RAM is whole: every page restored from the chain is a private page
                # of its mapping, so all its private pages, compared with no chain, are its state.
                # Not for a fork child: it maps a memory file that already holds the chain's
                # pages, which are then not private; the capture fails and the VM runs on.
                if machine.spec.mem_path != Path(_base(rec.base_dir).mem_file):
                    raise
                log.error("%s: %s; its whole memory is saved as one layer instead", rec.id, exc.message)
                full_tmp = self.repo.staging_path("mem")
                undo.add("full", lambda: asyncio.to_thread(full_tmp.unlink, True))
                full = await asyncio.to_thread(ml.capture, machine.pid, machine.spec.mem_path, full_tmp, [],
                                               uncached=uncached)
                memory = (await asyncio.to_thread(self.repo.import_layer, full_tmp, "mem", full.digest),)
        return info.pages, memory, dev_ref

    async def prefetch(self, cp: Checkpoint) -> None:
        """Bring the checkpoint's newest memory layer into the page cache (in the background):
        a sandbox that runs on from ``cp`` without having read it (a parked VM woken) compares
        its next capture with it."""
        if cp.memory:
            await asyncio.to_thread(ml.prefetch, self.repo.layer_path(cp.memory[-1].name))

    async def materialize(self, cp: Checkpoint, out: Path) -> Path:
        """One memory file = template memory + the checkpoint's layers, for many sandboxes to
        map copy-on-write (a fork's children): they share its page cache and start without
        copying pages into their RAM."""
        await asyncio.to_thread(self.repo.verify, cp)
        base = _base(cp.base)
        await asyncio.to_thread(base.ensure_memory)
        t0 = time.perf_counter()
        n = await asyncio.to_thread(ml.materialize, base.mem_file, [self.repo.layer_path(r.name) for r in cp.memory],
                                    out)
        log.info("materialized %s for checkpoint %s: %d MiB in %.1f ms", out.name, cp.id, n >> 20,
                 (time.perf_counter() - t0) * 1e3)
        return out

    def _disk_layers(self, top: Path) -> tuple[LayerRef, ...]:
        """The repository layers under the disk, oldest first, as the qcow2 headers chain
        them (the truth, whatever the records say)."""
        chain = backing_chain(top)
        return tuple(LayerRef(p.name, p.stat().st_size) for p in reversed(chain) if p.parent == self.repo.layers)

    async def _compact(self, memory: tuple[LayerRef, ...]) -> LayerRef:
        """One layer for the chain; on a full disk the spare files' space is given back and
        the merge tried once more, as a capture does."""
        out = self.repo.staging_path("mem")
        chain, digests = [self.repo.layer_path(r.name) for r in memory], [r.digest for r in memory]
        try:
            info = await asyncio.to_thread(ml.compact, chain, out, digests)
        except DiskFull:
            if not await asyncio.to_thread(self.repo.spares.clear):
                raise
            info = await asyncio.to_thread(ml.compact, chain, out, digests)
        try:
            return await asyncio.to_thread(self.repo.import_layer, out, "mem", info.digest)
        finally:
            await asyncio.to_thread(out.unlink, True)  # (imported: moved away; failed: not left in staging)

    # -- restore --------------------------------------------------------------------------

    async def restore(self, cp: Checkpoint, *, name: str, run_dir: Path, slot: Slot,
                      disk_top: Path | None = None, mem_file: Path | None = None,
                      verified: bool = False, nice: int = 0,
                      before_run: Callable[[], Awaitable[None]] | None = None) -> tuple[Machine, str]:
        """A running machine in the state of ``cp``; returns it and its disk overlay. ``nice``:
        its QEMU's CPU priority (vmm/priority.py), for one made ahead of time.
        ``disk_top`` resumes a paused sandbox on its own overlay; otherwise a new overlay
        is made over the checkpoint's sealed disk. ``mem_file``: a memory file that already
        holds the checkpoint's pages (``materialize``), mapped instead of the template's.
        ``verified``: the caller checked the layers already (once for all of a fork's children).
        ``before_run``: awaited once the state is loaded, before the guest runs its first
        instruction (a resume records its VM then: after that, the disk may move on).
        A filesystem-only checkpoint cold-boots the template's kernel on the disk instead, with
        RAM mapped over the template's memory file copy-on-write all the same (so a later
        pause captures the pages changed relative to it, as for any sandbox); the caller waits
        for the guest agent."""
        t0 = time.perf_counter()
        if not verified:  # the memory layers' checksums: while they are read, below
            await asyncio.to_thread(self.repo.verify, cp, memory_digests=False)
        base = _base(cp.base)
        if base.created_at != cp.base_created_at:
            raise SnapshotUnusable(
                f"snapshot {cp.name or cp.id} was taken on a build of template '{cp.template}' that no "
                f"longer exists (rebuilt after an image change); it cannot be restored")
        await asyncio.to_thread(base.ensure_memory)
        undo = Cleanup(f"restore of {name}")
        recorded = False
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if disk_top is None:
                disk_top = run_dir / "disk.qcow2"
                backing = self.repo.layer_path(cp.disk[-1].name) if cp.disk else base.disk
                await create_overlay(disk_top, backing, "qcow2")
                undo.add("disk", lambda: asyncio.to_thread(disk_top.unlink, True))  # type: ignore[union-attr]
            boot = cp.filesystem_only
            spec = MachineSpec(
                name=name, run_dir=run_dir, sock_dir=self.sock_dir, kernel=Path(base.kernel),
                initramfs=Path(base.initramfs), disk=disk_top, tools=Path(base.tools), mem_path=mem_file or base.mem_file,
                memory_mb=base.memory_mb, vcpus=base.vcpus, accel=self.accel, incoming=not boot,
                device_state_only=not boot, netns=slot.netns, tb_size_mb=self.tb_size_mb, tcg_cpu=base.tcg_cpu,
                guest_aslr=self.guest_aslr, **guest_link_spec(),
            )
            # Off the event loop: on a resume it replaces the run dir's machine.json, and ext4
            # may then flush behind pending write-back (see the seal above).
            await asyncio.to_thread(_write_spec, spec)
            t1 = time.perf_counter()
            machine = await Machine.launch(spec, nice=nice)
            undo.add("machine", machine.kill)
            t2 = time.perf_counter()
            try:
                pages = 0 if mem_file or boot else await asyncio.to_thread(
                    ml.restore, machine.pid, base.mem_file, [self.repo.layer_path(r.name) for r in cp.memory],
                    [None if verified else r.digest for r in cp.memory])
            except ml.CorruptLayer as exc:
                raise SnapshotUnusable(f"snapshot {cp.name or cp.id}: layer {exc.path.name} fails its checksum "
                                       f"(corrupt); delete the snapshot") from exc
            t3 = time.perf_counter()
            if cp.device is not None:  # i.e. not boot (spelled so for the type checker)
                await machine.load_state(self.repo.layer_path(cp.device.name), timeout=self.restore_timeout_s,
                                         run=before_run is None)
                if before_run is not None:
                    await self.crash_point("restore_before_run")
                    await before_run()
                    recorded = True
                    await machine.qmp("cont")
            log.info("restore %s: verify+disk %.1f ms, launch %.1f ms, %d pages %.1f ms, device state %.1f ms",
                     name, (t1 - t0) * 1e3, (t2 - t1) * 1e3, pages, (t3 - t2) * 1e3,
                     (time.perf_counter() - t3) * 1e3)
            undo.release()
            return machine, str(disk_top)
        except BaseException as exc:
            if recorded and isinstance(exc, asyncio.CancelledError):
                # The server stops: leave the recorded VM as a crash would (start_from_checkpoint).
                undo.release()
                await machine.detach()
            else:
                await undo.unwind()
            raise


def _base(base_dir: str) -> TemplateSnapshot:
    base = TemplateSnapshot.load(Path(base_dir))
    if base is None:
        raise SnapshotUnusable(f"the template snapshot {base_dir} this state was taken on no longer "
                               f"exists (its files were removed)")
    return base


def _write_spec(spec: MachineSpec) -> None:
    tmp = spec.run_dir / "machine.json.tmp"
    tmp.write_text(json.dumps(spec_to_json(spec)))
    os.replace(tmp, spec.run_dir / "machine.json")
