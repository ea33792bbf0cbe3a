"""Templates: their definitions, and the template snapshot each (template, shape) needs.

A template's first use in a given shape (vCPUs, memory) cold-boots it once until the guest
agent answers, then saves the device state with its RAM in a shared memory file. Every later
sandbox of that shape is a restore, never a boot. See docs/mechanisms/snapshots.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agentenv.config import DEFAULT_TCG_CPU
from agentenv.durable import publish
from agentenv.envd_client import EnvdClient, EnvdUnavailable
from agentenv.errors import GuestError, InvalidRequest, TemplateNotFound
from agentenv.images import GuestArtifacts
from agentenv.network import SlotPool
from agentenv.network.rules import GUEST_ADDR, GUEST_GW, GUEST_MAC
from agentenv.orchestrator.cleanup import Cleanup
from agentenv.storage import (
    TemplateSnapshot,
    create_overlay,
    remove_tree,
    seal_readonly,
)
from agentenv.storage.template_snapshot import TMP_SUFFIX
from agentenv.vmm import AccelInfo, Machine, MachineSpec

log = logging.getLogger(__name__)

# Where removed template snapshots wait for their deletion (a dir under the templates root, a
# suffix for memory files): out of every lookup's sight from the moment they are removed.
_TRASH = ".removing"


@dataclass(frozen=True)
class Template:
    """A bootable template. ``image``: where an OCI template came from (reference, manifest
    digest, the image's config); ``env``/``user``/``workdir``: the defaults every sandbox of it
    starts with (given to the agent before the template snapshot, so the snapshot carries them)."""

    name: str
    artifacts: GuestArtifacts
    memory_mb: int = 512
    vcpus: int = 1
    disk_mb: int = 4096
    image: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    workdir: str | None = None
    created_at: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "artifacts": self.artifacts.to_json(), "memory_mb": self.memory_mb,
                "vcpus": self.vcpus, "disk_mb": self.disk_mb, "image": self.image, "env": self.env,
                "user": self.user, "workdir": self.workdir, "created_at": self.created_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Template:
        return cls(name=str(d["name"]), artifacts=GuestArtifacts.from_json(d["artifacts"]),
                   memory_mb=int(d["memory_mb"]), vcpus=int(d["vcpus"]), disk_mb=int(d["disk_mb"]),
                   image=d.get("image"), env=dict(d.get("env") or {}), user=d.get("user"),
                   workdir=d.get("workdir"), created_at=float(d.get("created_at") or 0.0))


class TemplateCatalog:
    """Template definitions, one JSON file each under ``<data>/templates/<name>/``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, t: Template) -> None:
        d = self.root / t.name
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"template.json.{os.urandom(4).hex()}.tmp"  # two puts of one name at once
        try:
            tmp.write_text(json.dumps(t.to_json(), indent=1))
            publish(tmp, d / "template.json")  # a host crash leaves the old definition or this one
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, name: str) -> Template:
        try:
            return Template.from_json(json.loads((self.root / name / "template.json").read_text()))
        except (OSError, ValueError) as exc:
            raise TemplateNotFound(name) from exc

    def exists(self, name: str) -> bool:
        return (self.root / name / "template.json").exists()

    def delete(self, name: str) -> None:
        """Forget the definition; its snapshots are removed by ``SnapshotBuilder.remove_stale``
        once nothing uses them."""
        (self.root / name / "template.json").unlink(missing_ok=True)

    def list(self) -> list[Template]:
        out = []
        for p in sorted(self.root.glob("*/template.json")):
            try:
                out.append(Template.from_json(json.loads(p.read_text())))
            except (OSError, ValueError):
                continue
        return out


def _delete(paths: list[Path], then_empty: Path | None = None) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if then_empty is not None:
        with contextlib.suppress(OSError):  # absent, or another removal's files are in it
            then_empty.rmdir()


def guest_link_spec() -> dict[str, str]:
    """The guest side of the network link, identical in every sandbox."""
    return {"guest_mac": GUEST_MAC, "guest_ip": f"{GUEST_ADDR}/30", "guest_gw": GUEST_GW}


class SnapshotBuilder:
    """Makes (once) and finds the template snapshot of a (template, shape)."""

    def __init__(self, *, root: Path, mem_dir: Path, sock_dir: Path, slots: SlotPool, accel: AccelInfo,
                 boot_timeout_s: float, tb_size_mb: int, tcg_cpu: str = DEFAULT_TCG_CPU,
                 guest_aslr: bool = False) -> None:
        self.guest_aslr = guest_aslr
        self.tcg_cpu = tcg_cpu
        self.root = root
        self.sock_dir = sock_dir
        self.mem_dir = mem_dir
        self.slots = slots
        self.accel = accel
        self.boot_timeout_s = boot_timeout_s
        self.tb_size_mb = tb_size_mb
        self._locks: dict[Path, asyncio.Lock] = {}
        # By snapshot dir, which names everything the boot depends on: a template updated under
        # its name (a pull of a newer image) is a new key, never the old image's snapshot.
        self._cache: dict[Path, TemplateSnapshot] = {}

    def snapshot_dir(self, t: Template, vcpus: int, memory_mb: int) -> Path:
        """Named after everything the boot depends on, so a change makes a new snapshot."""
        key = hashlib.sha256(json.dumps([
            t.artifacts.to_json(), self.accel.accel, self.guest_aslr, t.env, t.user, t.workdir, self.cpu_model,
        ]).encode()).hexdigest()[:12]
        return self.root / t.name / "snapshots" / f"{vcpus}cpu-{memory_mb}M-{key}"

    @property
    def cpu_model(self) -> str:
        """The -cpu of new snapshots: the TCG model, or "host" under KVM."""
        return self.accel.cpu_model(self.tcg_cpu)

    async def remove_stale(self, catalog: TemplateCatalog, in_use: Callable[[], set[str]]) -> list[str]:
        """Remove template snapshots built from inputs that are no longer current (an image or
        accelerator change made new ones) unless ``in_use()`` names them, by directory or
        memory file (a checkpoint or a sandbox still needs them, or a create, fork or wake
        has claimed them), or a lookup or build of theirs is in progress. Each holds ~100+
        MiB of tmpfs.

        The candidates are found in a thread; whether each is still unused is decided, and it
        is moved out of sight, on the event loop with no await in between. A create claims the
        snapshot it looked up with no await after its lookup either, so of the two one always
        sees the other: a snapshot is never removed under a sandbox that starts from it."""
        stale, orphans = await asyncio.to_thread(self._find_stale, catalog)
        keep = in_use() | self._busy()
        trash = self.root / _TRASH
        doomed: list[Path] = []
        removed: list[str] = []

        def hide(path: Path, to: Path) -> None:  # gone from lookups at once; deleted below, in a thread
            os.replace(path, to)
            doomed.append(to)

        for d, mem in stale:
            if str(d) in keep or (mem is not None and str(mem) in keep) or not d.exists():
                continue
            self._cache.pop(d, None)
            trash.mkdir(exist_ok=True)
            hide(d, trash / f"{d.parent.parent.name}-{d.name}")
            if mem is not None and mem.exists():
                hide(mem, mem.with_name(mem.name + _TRASH))
            removed.append(str(d))
        for mem in orphans:
            if str(mem) not in keep and mem.exists():
                hide(mem, mem.with_name(mem.name + _TRASH))
                removed.append(str(mem))
        await asyncio.to_thread(_delete, doomed, trash)
        for d in removed:
            log.info("removed stale template snapshot %s", d)
        return removed

    def _mem_file(self, d: Path) -> Path:
        """The memory file a build of snapshot dir ``d`` writes (``<root>/<template>/snapshots/<d>``)."""
        return self.mem_dir / f"{d.parent.parent.name}-{d.name}.mem"

    def _busy(self) -> set[str]:
        """Snapshot dirs (and their memory files) a lookup or build holds the lock of."""
        dirs = [d for d, lock in self._locks.items() if lock.locked()]
        return {str(d) for d in dirs} | {str(self._mem_file(d)) for d in dirs}

    def _find_stale(self, catalog: TemplateCatalog) -> tuple[list[tuple[Path, Path | None]], list[Path]]:
        """Snapshots (dir, memory file) not of a current template, and memory files no
        snapshot owns (a build cut short by a crash); what an earlier removal left in the
        trash (a crash) is deleted here."""
        current = {t.name: self.snapshot_dir(t, 1, 2).name.rsplit("-", 1)[1] for t in catalog.list()}
        leftovers = list((self.root / _TRASH).glob("*")) if (self.root / _TRASH).exists() else []
        if self.mem_dir.exists():
            leftovers += self.mem_dir.glob(f"*{_TRASH}")
        _delete(leftovers)
        stale: list[tuple[Path, Path | None]] = []
        owned: set[str] = set()
        for meta in self.root.glob("*/snapshots/*/meta.json"):
            d = meta.parent
            snap = TemplateSnapshot.load(d)
            if snap is not None:
                owned.add(str(snap.mem_file))
            if current.get(d.parent.parent.name) != d.name.rsplit("-", 1)[1]:
                stale.append((d, snap.mem_file if snap is not None else None))
        orphans = [mem for mem in (self.mem_dir.glob("*.mem") if self.mem_dir.exists() else ())
                   if str(mem) not in owned]
        # copies back from the data disk that a crash interrupted (one in progress is minutes younger)
        for tmp in self.mem_dir.glob(f"*.mem.*{TMP_SUFFIX}") if self.mem_dir.exists() else ():
            with contextlib.suppress(OSError):
                if time.time() - tmp.stat().st_mtime > 600:
                    tmp.unlink()
                    log.info("removed an interrupted copy of a template memory file, %s", tmp)
        return stale, orphans

    def forget(self, template: str) -> None:
        """Drop cached lookups of a deleted template (its files go with ``remove_stale``)."""
        for key in [k for k in self._cache if k.parent.parent.name == template]:
            del self._cache[key]

    def dirs_of(self, template: str) -> list[Path]:
        return [m.parent for m in self.root.glob(f"{template}/snapshots/*/meta.json")]

    async def get(self, t: Template, vcpus: int, memory_mb: int) -> TemplateSnapshot:
        """The snapshot for this shape, building it on first use (concurrent callers wait)."""
        d = key = self.snapshot_dir(t, vcpus, memory_mb)
        snap = self._cache.get(key)
        if snap and snap.mem_file.exists():
            return snap
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            snap = TemplateSnapshot.load(d)
            if snap is None:
                snap = await self._build(t, vcpus, memory_mb, d)
            elif not snap.mem_file.exists():  # after a host reboot: the same snapshot, not a new one
                await asyncio.to_thread(snap.ensure_memory)
                log.info("template %s: memory file %s restored from %s", t.name, snap.mem_file, snap.memory_copy)
            elif not snap.memory_copy.exists():  # made before durable copies were kept
                await asyncio.to_thread(snap.keep_memory)
            self._cache[key] = snap
            return snap

    async def _build(self, t: Template, vcpus: int, memory_mb: int, d: Path) -> TemplateSnapshot:
        if not t.artifacts.rootfs.exists():
            raise InvalidRequest(f"template '{t.name}' has no root filesystem at {t.artifacts.rootfs}; run `aenv setup`")
        await remove_tree(d)
        d.mkdir(parents=True)
        self.mem_dir.mkdir(parents=True, exist_ok=True)
        mem_file = self._mem_file(d)
        mem_file.unlink(missing_ok=True)
        undo = Cleanup(f"template snapshot {d}")
        undo.add("dir", lambda: remove_tree(d))
        undo.add("mem", lambda: asyncio.to_thread(mem_file.unlink, True))
        machine: Machine | None = None
        try:
            await create_overlay(d / "disk.qcow2", t.artifacts.rootfs, "raw")
            slot = await self.slots.acquire()
            undo.add("slot", lambda: self.slots.release(slot))
            spec = MachineSpec(
                name=f"tmpl-{t.name}", run_dir=d / "run", sock_dir=self.sock_dir, kernel=t.artifacts.kernel,
                initramfs=t.artifacts.initramfs, disk=d / "disk.qcow2", tools=t.artifacts.tools, mem_path=mem_file,
                memory_mb=memory_mb, vcpus=vcpus, accel=self.accel, mem_share=True,
                netns=slot.netns, tb_size_mb=self.tb_size_mb, tcg_cpu=self.tcg_cpu, guest_aslr=self.guest_aslr,
                **guest_link_spec(),
            )
            t0 = time.monotonic()
            machine = await Machine.launch(spec)
            undo.add("machine", machine.kill)
            async with EnvdClient.for_guest(slot.guest_url) as envd:
                try:
                    await envd.wait_healthy(self.boot_timeout_s)
                except EnvdUnavailable as exc:
                    console = spec.console_tail() or "(empty)"
                    raise GuestError(
                        f"template '{t.name}' did not boot: its guest agent did not answer within "
                        f"{self.boot_timeout_s:.0f}s. Console: {console}") from exc
                boot_ms = (time.monotonic() - t0) * 1000
                # Run what every sandbox runs first (its /init, a command as root and as the
                # default user) before the snapshot, so the pages this touches (binaries, page
                # cache, agent heap) are in the shared template memory, not copied per sandbox.
                await envd.init(sandbox_id="template", template_id=t.name, env_vars=t.env, access_token=None,
                                default_user=t.user, default_workdir=t.workdir)
                await envd.warm_up()
            t1 = time.monotonic()
            await machine.save_template_state(d / "state")
            snapshot_ms = (time.monotonic() - t1) * 1000
            undo.done("machine")
            await machine.kill()
            undo.done("slot")
            await self.slots.release(slot)
            await remove_tree(d / "run")
            seal_readonly(d / "disk.qcow2")
            snap = TemplateSnapshot(
                template=t.name, dir=d, mem_file=mem_file, memory_mb=memory_mb, vcpus=vcpus,
                kernel=str(t.artifacts.kernel), initramfs=str(t.artifacts.initramfs),
                rootfs=str(t.artifacts.rootfs), tools=str(t.artifacts.tools), created_at=time.time(), boot_ms=boot_ms,
                snapshot_ms=snapshot_ms, tcg_cpu=self.tcg_cpu,
            )
            t2 = time.monotonic()
            await asyncio.to_thread(snap.keep_memory)
            keep_ms = (time.monotonic() - t2) * 1000
            await asyncio.to_thread(snap.save)
            undo.release()
            log.info("template %s snapshotted (%d vCPU, %d MiB): boot %.0f ms, snapshot %.1f ms, "
                     "memory kept on disk in %.0f ms", t.name, vcpus, memory_mb, boot_ms, snapshot_ms, keep_ms)
            return snap
        except BaseException:
            await undo.unwind()
            raise

