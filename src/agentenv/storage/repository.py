"""The snapshot repository: immutable layer files plus one manifest per checkpoint.

``posix_fs`` backend (a local or shared filesystem); the interface is what an object-storage
backend will implement later::

    <root>/layers/mem-<xxh3>      memory layer, named by its checksum (content-addressed)
    <root>/layers/dev-<xxh3>      device state, named by its checksum
    <root>/layers/disk-<id>.qcow2 sealed disk layer; its qcow2 header names its parent layer
    <root>/manifests/<id>.json    one per checkpoint, written atomically (temp + fsync + rename)
    <root>/staging/               files being written; removed by recovery and GC
    <root>/spare/                 freed memory layers, to be written over (storage/spares.py)

Nothing in ``layers/`` is ever modified in place (a freed memory layer may be written over
once it has left it for ``spare/``, storage/spares.py). A layer is referenced by manifests and by the sandboxes
running on it (their records, passed to ``gc`` as pins); ``gc`` deletes a layer only when
nothing references it, so deleting a snapshot or a sandbox never removes a layer another one
uses. References are counted from the manifests themselves, not kept in a separate counter
that a crash could leave wrong.

Disk layers are not content-hashed: a sealed overlay is unique by construction and hashing a
GiB would put seconds on the snapshot path. Their size is recorded and checked instead; memory
and device layers are verified against their checksum at every restore (memory layers in the
pass that copies them into the machine, ``memory_layers.restore``).
"""

from __future__ import annotations

import asyncio
import errno
import filecmp
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from agentenv.durable import fsync_path
from agentenv.errors import (
    DiskFull,
    ManifestDamaged,
    SnapshotNotFound,
    SnapshotUnusable,
    StorageError,
)
from agentenv.storage.memory_layers import digest_matches
from agentenv.storage.spares import SparePool

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class LayerRef:
    name: str
    size: int
    digest: str = ""  # xxh3-128; empty for disk layers (size-checked only)


@dataclass(frozen=True)
class Checkpoint:
    """Everything needed to start a sandbox from a saved state.

    ``kind``: ``snapshot`` (named, listed, launchable as a template), ``pause`` (the saved state
    of one paused sandbox), ``fork`` (the checkpoint children of one fork start from),
    ``template`` (a built template, launchable by name) or ``build-step`` (the layer cache of
    template builds, named by its cache key).
    The memory chain is relative to the template snapshot in ``base`` (its memory file);
    ``base_created_at`` identifies that exact build of it. A **filesystem-only** checkpoint
    (E2B's ``memory: false``) has no memory layers and no device state (``device`` is None):
    starting from it cold-boots the template's kernel on its disk.
    ``default_user``/``default_workdir``: what a cold boot gives the fresh guest agent (with
    ``env_vars``), since no agent memory carries them; None means the template's.
    """

    id: str
    kind: str
    template: str
    base: str
    base_created_at: float
    vcpus: int
    memory_mb: int
    disk_mb: int
    memory: tuple[LayerRef, ...]
    device: LayerRef | None  # None: filesystem only
    disk: tuple[LayerRef, ...]  # sealed layers, oldest first, over the template's disk
    disk_top: str | None = None  # pause: the sandbox's own overlay, resumed in place
    name: str | None = None
    source_sandbox: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None  # the guest's token when the state was saved
    created_at: float = 0.0
    default_user: str | None = None
    default_workdir: str | None = None
    # A pause taken while the guest agent did not answer: restoring that memory brings the
    # hung agent back, so only a resume without memory (a reboot of the disk) is allowed.
    guest_unresponsive: bool = False

    @property
    def filesystem_only(self) -> bool:
        return self.device is None

    def layers(self) -> tuple[LayerRef, ...]:
        return (*self.memory, *((self.device,) if self.device else ()), *self.disk)

    def layer_names(self) -> set[str]:
        return {r.name for r in self.layers()}

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Checkpoint:
        d = dict(d)
        d["memory"] = tuple(LayerRef(**x) for x in d["memory"])  # type: ignore[arg-type, union-attr]
        d["disk"] = tuple(LayerRef(**x) for x in d["disk"])  # type: ignore[arg-type, union-attr]
        d["device"] = LayerRef(**d["device"]) if d.get("device") else None  # type: ignore[arg-type]
        return cls(**d)  # type: ignore[arg-type]

    def with_(self, **changes: object) -> Checkpoint:
        return replace(self, **changes)  # type: ignore[arg-type]


# Kinds a sandbox can be started from by name: named snapshots and built templates.
LAUNCHABLE = ("snapshot", "template")


def new_checkpoint_id() -> str:
    return uuid.uuid4().hex[:20]


class SnapshotRepository:
    """posix_fs repository. Blocking file work runs off the event loop; ``lock`` serialises
    writers with the garbage collector (a layer imported for a manifest not yet written must
    not be collected)."""

    def __init__(self, root: Path, spare_bytes: int = 0) -> None:
        self.root = root
        self.layers = root / "layers"
        self.manifests = root / "manifests"
        self.staging = root / "staging"
        for d in (self.layers, self.manifests, self.staging):
            d.mkdir(parents=True, exist_ok=True)
        self.spares = SparePool(root / "spare", spare_bytes)
        self.lock = asyncio.Lock()
        # The manifests as parsed, for lookups and listings that a node with thousands of them
        # cannot afford to re-read on the event loop (see _index).
        self._index_lock = threading.Lock()
        self._index: dict[str, Checkpoint] | None = None
        self._unreadable: tuple[str, ...] = ()  # manifests the index could not parse
        self._index_mtime = -1
        self._generation = 0  # bumped by every change this object makes (see _index_now)
        self._names: dict[str, Checkpoint] | None = None  # launchable checkpoints by name (see _named)

    # -- layers ---------------------------------------------------------------------------

    def staging_path(self, hint: str) -> Path:
        return self.staging / f"{uuid.uuid4().hex[:12]}-{hint}"

    def layer_path(self, name: str) -> Path:
        return self.layers / name

    def import_layer(self, tmp: Path, kind: str, digest: str) -> LayerRef:
        """Move a finished staging file in under its content address. An identical layer
        already stored is reused (and compared byte for byte: the name is a 128-bit
        non-cryptographic hash, so a collision must not be able to alias two states)."""
        size = tmp.stat().st_size
        name = f"{kind}-{digest}"
        n = 0
        while True:
            dest = self.layers / (name if n == 0 else f"{name}.{n}")
            if not dest.exists():
                os.replace(tmp, dest)
                break
            if dest.stat().st_size == size and filecmp.cmp(dest, tmp, shallow=False):
                tmp.unlink()
                break
            n += 1
        return LayerRef(dest.name, size, digest)

    def ensure_room(self) -> None:
        """``check_writable``, after giving back the spare files' space if that is what it lacks."""
        try:
            check_writable(self.root)
        except DiskFull:
            if not self.spares.clear():
                raise
            check_writable(self.root)

    def link_disk(self, overlay: Path) -> LayerRef:
        """Seal a stopped sandbox's overlay into the repository (a hard link: the running
        QEMU keeps reading it as its backing file, and the link outlives the sandbox)."""
        name = f"disk-{uuid.uuid4().hex[:16]}.qcow2"
        dest = self.layers / name
        os.link(overlay, dest)
        os.chmod(dest, 0o444)
        return LayerRef(name, dest.stat().st_size)

    def verify(self, cp: Checkpoint, memory_digests: bool = True) -> None:
        """Refuse a checkpoint whose layers are missing, truncated or fail their checksum.
        ``memory_digests=False``: the memory layers' checksums are left to the caller, which
        checks them while it reads the layers anyway (``memory_layers.restore``)."""
        memory = set() if memory_digests else {r.name for r in cp.memory}
        for ref in cp.layers():
            p = self.layers / ref.name
            try:
                size = p.stat().st_size
            except OSError:
                raise SnapshotUnusable(f"snapshot {cp.name or cp.id}: layer {ref.name} is missing "
                                       f"from {self.layers}") from None
            if size != ref.size:
                raise SnapshotUnusable(f"snapshot {cp.name or cp.id}: layer {ref.name} has {size} bytes, "
                                       f"expected {ref.size} (truncated or replaced)")
            if ref.digest and ref.name not in memory and not digest_matches(p, ref.digest):
                raise SnapshotUnusable(f"snapshot {cp.name or cp.id}: layer {ref.name} fails its checksum "
                                       f"(corrupt); delete the snapshot")

    # -- manifests ------------------------------------------------------------------------

    def put(self, cp: Checkpoint, durable: bool = True) -> None:
        """Publish a manifest atomically: readers see the old one or the complete new one.
        ``durable`` also fsyncs it (and the directory) so it survives a host crash; a pause or
        fork manifest only needs to survive the server, and skips the disk round trips."""
        tmp = self.staging / f"{cp.id}.{os.urandom(4).hex()}.json.tmp"  # concurrent puts of one id
        try:
            with open(tmp, "w") as f:
                json.dump(cp.to_json(), f, indent=1)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise DiskFull(f"no space left on {self.root} for the manifest of {cp.id}; free disk space") from exc
            raise StorageError(f"cannot write the manifest of {cp.id} in {self.root}: {exc}") from exc
        before = self._mtime()
        os.replace(tmp, self.manifests / f"{cp.id}.json")
        self._changed(before, cp.id, lambda index: index.__setitem__(cp.id, cp))
        if durable:
            fsync_path(self.manifests)

    def make_durable(self, cp: Checkpoint) -> None:
        """fsync a published checkpoint's layers, then its manifest and the manifests directory:
        after a host crash its manifest is there only if its layers are. Layers collected
        meanwhile are skipped (the checkpoint was deleted)."""
        self._sync_layers(cp)
        try:
            fsync_path(self.manifests / f"{cp.id}.json")
        except FileNotFoundError:
            return
        fsync_path(self.manifests)

    def put_durably(self, cp: Checkpoint) -> None:
        """``put`` a manifest that must survive a host crash, its layers fsynced first."""
        self._sync_layers(cp)
        self.put(cp, True)

    def _sync_layers(self, cp: Checkpoint) -> None:
        for ref in cp.layers():
            try:
                fsync_path(self.layers / ref.name)
            except FileNotFoundError:
                continue

    def get(self, id_or_name: str) -> Checkpoint:
        if not NAME_RE.fullmatch(id_or_name):
            raise SnapshotNotFound(id_or_name)
        p = self.manifests / f"{id_or_name}.json"
        if p.exists():
            try:
                data = p.read_bytes()
            except OSError as exc:
                raise SnapshotUnusable(f"snapshot {id_or_name}: unreadable manifest ({exc})") from exc
            try:
                return Checkpoint.from_json(json.loads(data))
            except (ValueError, TypeError, KeyError) as exc:
                raise ManifestDamaged(f"snapshot {id_or_name}: unreadable manifest ({exc}); deleting the "
                                      f"snapshot by its id removes it") from exc
        cp = self._named().get(id_or_name)
        if cp is None:
            raise SnapshotNotFound(id_or_name)
        return cp

    def _mtime(self) -> int:
        return self.manifests.stat().st_mtime_ns

    def _index_now(self) -> dict[str, Checkpoint]:
        """Every readable manifest by id. Kept in memory: this object's own puts and deletes
        update it; it is read again from the directory when the directory's mtime is not the
        one it was made at (another process's change: a node sharing the repository). Callers
        do not mutate it (a new dict replaces it on every change)."""
        mtime = self._mtime()  # taken first: a change while the files are read shows next time
        with self._index_lock:
            if self._index is not None and self._index_mtime == mtime:
                return self._index
            generation = self._generation
        cps, unreadable, transient = self._read_all()
        index = {cp.id: cp for cp in cps}
        with self._index_lock:
            # Kept only if no change of ours came in meanwhile (its mtime may not have moved:
            # a coarse clock) and the read had no passing failure (EMFILE, EIO).
            if generation == self._generation and not transient:
                self._index, self._index_mtime, self._names = index, mtime, None
            self._unreadable = unreadable
        return index

    def _changed(self, before: int, cp_id: str, update: Callable[[dict[str, Checkpoint]], None]) -> None:
        """After this object changed manifest ``cp_id``: apply the change to the index if it was
        current until then; otherwise (another change came in between) drop it. The manifest
        is no longer an unreadable one either way (replaced or deleted)."""
        after = self._mtime()
        with self._index_lock:
            self._generation += 1
            self._unreadable = tuple(n for n in self._unreadable if n != f"{cp_id}.json")
            if self._index is not None and self._index_mtime == before:
                index = dict(self._index)
                update(index)
                self._index, self._index_mtime = index, after
            else:
                self._index = None
            self._names = None

    def _named(self) -> dict[str, Checkpoint]:
        """Launchable checkpoints by name, the newest for each (a create by name asks this, on
        the event loop): from the index, without reading a file."""
        index = self._index_now()
        with self._index_lock:
            if self._names is not None and index is self._index:
                return self._names
        names: dict[str, Checkpoint] = {}
        for cp in sorted(index.values(), key=lambda c: c.created_at, reverse=True):
            if cp.name and cp.kind in LAUNCHABLE:
                names.setdefault(cp.name, cp)
        with self._index_lock:
            if index is self._index:
                self._names = names
        return names

    def exists(self, id_or_name: str) -> bool:
        try:
            self.get(id_or_name)
            return True
        except SnapshotNotFound:
            return False

    def list(self, kind: str | None = None, strict: bool = False) -> list[Checkpoint]:
        """The published checkpoints, newest first (from the index). An unreadable manifest is
        left out, or with ``strict`` raises StorageError (the GC must not take its layers for
        unreferenced)."""
        cps = list(self._index_now().values())
        if strict and (bad := self._unreadable):
            raise StorageError(f"manifests {', '.join(bad)} in {self.manifests} are unreadable; nothing is "
                               f"collected until they are repaired or deleted (by snapshot id)")
        return sorted((cp for cp in cps if kind is None or cp.kind == kind), key=lambda c: c.created_at,
                      reverse=True)

    def _read_all(self) -> tuple[list[Checkpoint], tuple[str, ...], bool]:
        """Every manifest in the directory, parsed; the names of those that are not; whether a
        read failed for a passing reason (not the file's content)."""
        out, bad, transient = [], [], False
        for p in self.manifests.glob("*.json"):
            try:
                cp = Checkpoint.from_json(json.loads(p.read_text()))
            except FileNotFoundError:
                continue  # deleted since the listing
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("unreadable manifest %s skipped (%r)", p, exc)
                bad.append(p.name)
                transient = transient or isinstance(exc, OSError)
                continue
            out.append(cp)
        return out, tuple(bad), transient

    def remove_torn(self) -> list[str]:
        """Delete manifests a host crash tore: empty, or only NUL bytes (renamed into place
        before their data reached the disk: a pause's or a fork's is not fsynced, a snapshot's
        only after its layers). They name no layer and no snapshot, and an unreadable
        manifest stops every gc (``list(strict=True)``): the disk would fill. Other unreadable
        manifests are kept for someone to look at. Call at start, before anything else runs.
        Only the manifests the index could not parse are read again."""
        self._index_now()
        removed = []
        for name in self._unreadable:
            try:
                data = (self.manifests / name).read_bytes()
            except OSError:
                continue
            if not data.strip(b"\0"):
                self.delete(name.removesuffix(".json"))
                removed.append(name)
        return removed

    def delete(self, cp_id: str) -> None:
        before = self._mtime()
        (self.manifests / f"{cp_id}.json").unlink(missing_ok=True)
        self._changed(before, cp_id, lambda index: index.pop(cp_id, None))

    # -- garbage collection ---------------------------------------------------------------

    def gc(self, pins: Iterable[str] = (), staging_older_than: float = 0.0) -> list[str]:
        """Delete layers that no manifest and no pin references, and staging leftovers older
        than ``staging_older_than`` seconds. Caller holds ``lock``. Raises StorageError, having
        deleted nothing, if a manifest cannot be read."""
        keep = set(pins)
        for cp in self.list(strict=True):
            keep |= cp.layer_names()
        removed = []
        for p in self.layers.iterdir():
            if p.name not in keep:
                if p.name.startswith("mem-"):
                    self.spares.offer(p)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p.name)
        now = time.time()
        for p in self.staging.iterdir():
            try:
                if now - p.stat().st_mtime >= staging_older_than:
                    p.unlink(missing_ok=True)
            except OSError:
                continue
        if removed:
            log.info("repository gc removed %d unreferenced layers", len(removed))
        return removed


def check_writable(path: Path) -> None:
    """Fail early with a clear message when the repository's disk cannot take a file."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        raise StorageError(f"snapshot repository {path} is not accessible: {exc}") from exc
    if st.f_bavail * st.f_frsize < 1 << 20:
        raise DiskFull(f"no space left on {path} for snapshot layers; free disk space")
