"""The repository's garbage collection never takes a layer something still needs: a manifest it
cannot read, a sandbox record that takes layers over from a manifest while a collection runs,
a VM whose disk moved to a new top before its record did. The orchestrator's real ``pins`` and
``gc`` run on stand-in sandboxes (records with real qcow2 overlays; no QEMU is needed to read
which layers they use)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest
import xxhash

from agentenv.errors import (
    DiskFull,
    ManifestDamaged,
    SnapshotNotFound,
    SnapshotUnusable,
    StorageError,
)
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.orchestrator.service import Orchestrator
from agentenv.orchestrator.store import SandboxRecord
from agentenv.storage import Checkpoint, LayerRef, SnapshotRepository
from agentenv.storage import memory_layers as ml


def _checkpoint(cp_id: str, kind: str, memory: tuple[LayerRef, ...] = (), device: LayerRef | None = None,
                disk: tuple[LayerRef, ...] = ()) -> Checkpoint:
    return Checkpoint(id=cp_id, kind=kind, template="t", base="/b", base_created_at=0, vcpus=1, memory_mb=64,
                      disk_mb=64, memory=memory, device=device, disk=disk, name=None)


def _layer(repo: SnapshotRepository, name: str, data: bytes = b"m" * 4096) -> LayerRef:
    p = repo.layer_path(name)
    p.write_bytes(data)
    return LayerRef(name, len(data), "")


def _qcow2(path: Path, backing: Path | None = None) -> Path:
    argv = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing is not None:
        argv += ["-b", str(backing), "-F", "qcow2"]
    subprocess.run([*argv, str(path), "64M"], check=True)
    return path


class _Store:
    async def put(self, rec: SandboxRecord) -> None:
        await asyncio.sleep(0)


def _orchestrator(root: Path) -> types.SimpleNamespace:
    """The parts of an Orchestrator that ``pins``, ``gc`` and ``drop_checkpoint`` use."""
    (root / "shm").mkdir(parents=True, exist_ok=True)
    orch = types.SimpleNamespace(repo=SnapshotRepository(root / "repo"), _starting=[], _live={}, _claimed=collections.Counter(),
                                 store=_Store(), settings=types.SimpleNamespace(mem_dir=root / "shm"))
    for name in ("pins", "gc", "drop_checkpoint", "_mapped"):
        setattr(orch, name, types.MethodType(getattr(Orchestrator, name), orch))
    return orch


def _record(root: Path, sid: str, disk: Path, **kw: object) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(id=sid, template="t", state=State.RUNNING, vcpus=1, memory_mb=64, disk_mb=64,
                         started_at=now, end_at=now + 600, access_token="t", run_dir=str(root / sid),
                         disk_path=str(disk), **kw)


def test_an_unreadable_manifest_stops_the_collection(tmp_path: Path) -> None:
    repo = SnapshotRepository(tmp_path / "repo")
    assert repo.list() == []
    ref = _layer(repo, "dev-" + "a" * 32)
    d = _checkpoint("c1", "snapshot", device=ref).to_json()
    d["written_by_a_newer_version"] = 1  # Checkpoint(**d) cannot take it
    time.sleep(0.05)  # the directory's mtime moves on the kernel's coarse clock
    m = repo.manifests / "c1.json"
    m.write_text(json.dumps(d))  # another node sharing the repository
    orphan = _layer(repo, "mem-" + "b" * 32)
    with pytest.raises(Exception, match="unreadable"):
        repo.gc()
    assert repo.layer_path(ref.name).exists() and repo.layer_path(orphan.name).exists()
    time.sleep(0.05)
    m.unlink()  # once the manifest is repaired or removed, collection goes on
    assert sorted(repo.gc()) == sorted([ref.name, orphan.name])


def test_layers_handed_from_a_manifest_to_a_record_survive_a_concurrent_gc(tmp_path: Path) -> None:
    """A fork: its children are registered, then its manifest is dropped, while a gc (started
    by a kill elsewhere) reads the sandboxes' references and then the manifests."""
    orch = _orchestrator(tmp_path)
    proto = _qcow2(tmp_path / "proto.qcow2", _qcow2(tmp_path / "base.qcow2"))
    for i in range(40):  # other sandboxes, whose overlays each gc reads
        (tmp_path / f"s{i}").mkdir()
        disk = tmp_path / f"s{i}" / "disk.qcow2"
        shutil.copy(proto, disk)
        orch._live[f"s{i}"] = LiveSandbox(_record(tmp_path, f"s{i}", disk))

    async def trial(k: int) -> bool:
        mem = _layer(orch.repo, f"mem-{k:032x}")
        cp = _checkpoint(f"fork{k}", "fork", memory=(mem,))
        orch.repo.put(cp, False)
        gc = asyncio.create_task(orch.gc())
        await asyncio.sleep(random.uniform(0, 0.004))
        child = LiveSandbox(_record(tmp_path, f"c{k}", proto, origin=cp))
        orch._live[child.id] = child
        await orch.store.put(child.record)
        await orch.drop_checkpoint(cp.id)
        await gc
        kept = orch.repo.layer_path(mem.name).exists()
        del orch._live[child.id]
        return kept

    async def trials() -> list[bool]:
        return [await trial(k) for k in range(60)]

    assert all(asyncio.run(trials()))


def test_the_overlay_a_vm_writes_to_pins_its_chain_before_the_record_follows(tmp_path: Path) -> None:
    """A snapshot sealed the overlay into the repository and moved the VM to a new top, then
    failed: the record still names the old top (unlinked), the machine the new one."""
    orch = _orchestrator(tmp_path)
    base = _qcow2(tmp_path / "base.qcow2")
    sealed = orch.repo.layer_path("disk-0123456789abcdef.qcow2")
    _qcow2(sealed, base)
    run_dir = tmp_path / "s1"
    run_dir.mkdir()
    new_top = _qcow2(run_dir / "disk-0123.qcow2", sealed)
    live = LiveSandbox(_record(tmp_path, "s1", run_dir / "disk.qcow2"))  # gone: unlinked by the seal
    live.machine = types.SimpleNamespace(  # type: ignore[assignment]
        spec=types.SimpleNamespace(disk=new_top, mem_path=tmp_path / "mem"))
    orch._live["s1"] = live
    assert asyncio.run(orch.gc()) == []
    assert sealed.exists()
    live.machine.spec.disk = run_dir / "missing.qcow2"  # a top that must exist and does not: keep every disk layer
    assert asyncio.run(orch.gc()) == []
    assert sealed.exists()


def _memory_layer(path: Path, pages: dict[int, bytes]) -> ml.LayerInfo:
    with open(path, "wb") as f:
        f.seek(ml.PAGE)
        h = xxhash.xxh3_128()
        for n in sorted(pages):
            f.write(pages[n])
            h.update(pages[n])
        return ml._seal(f, h, 16 * ml.PAGE, [(n, 1) for n in sorted(pages)], path)


def test_compaction_refuses_a_corrupt_layer(tmp_path: Path) -> None:
    a = _memory_layer(tmp_path / "a", {0: b"A" * ml.PAGE, 1: b"B" * ml.PAGE})
    b = _memory_layer(tmp_path / "b", {2: b"C" * ml.PAGE})
    ok = ml.compact([a.path, b.path], tmp_path / "ok", [a.digest, b.digest])
    assert ok.pages == 3
    raw = bytearray((tmp_path / "a").read_bytes())
    raw[ml.PAGE + 10] ^= 0xFF  # bit rot in page 0
    (tmp_path / "a").write_bytes(bytes(raw))
    with pytest.raises(ml.CorruptLayer):
        ml.compact([a.path, b.path], tmp_path / "out", [a.digest, b.digest])
    assert not (tmp_path / "out").exists()


def test_a_device_state_is_checked_whole(tmp_path: Path) -> None:
    p = tmp_path / "dev"
    p.write_bytes(bytes(range(256)) * 120)
    digest = ml.whole_file_digest(p)
    assert ml.digest_matches(p, digest)
    raw = bytearray(p.read_bytes())
    raw[100] ^= 0xFF  # inside the first page, which a memory layer's digest leaves out
    p.write_bytes(bytes(raw))
    assert not ml.digest_matches(p, digest)


def test_a_rebuild_of_the_index_never_hides_a_manifest_written_meanwhile(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing rebuilds the index in one thread while a put lands in another, and the
    directory's mtime does not move (a coarse clock): the rebuild must not install its older
    read over the put, or the GC takes the new manifest's layers for unreferenced."""
    import threading

    repo = SnapshotRepository(tmp_path / "repo")
    monkeypatch.setattr(repo, "_mtime", lambda: 42)  # the clock did not tick
    real_read = repo._read_all
    reading, put_done = threading.Event(), threading.Event()

    def slow_read():  # type: ignore[no-untyped-def]
        out = real_read()
        reading.set()
        put_done.wait(10)
        return out

    monkeypatch.setattr(repo, "_read_all", slow_read)
    lister = threading.Thread(target=repo.list)
    lister.start()
    assert reading.wait(10)
    monkeypatch.setattr(repo, "_read_all", real_read)
    ref = _layer(repo, "mem-" + "c" * 32)
    repo.put(_checkpoint("new", "snapshot", memory=(ref,)))
    put_done.set()
    lister.join(10)
    assert [cp.id for cp in repo.list()] == ["new"]
    assert repo.gc() == [] and repo.layer_path(ref.name).exists()


def test_an_unreadable_manifest_deleted_by_this_node_no_longer_stops_the_gc(tmp_path: Path) -> None:
    repo = SnapshotRepository(tmp_path / "repo")
    assert repo.list() == []
    time.sleep(0.05)
    (repo.manifests / "bad.json").write_text("{truncated")  # a pause manifest cut by a host crash
    with pytest.raises(Exception, match="unreadable"):
        repo.gc()
    repo.delete("bad")  # its sandbox is killed
    assert repo.gc() == []


def test_only_a_manifest_whose_content_does_not_parse_is_damaged(tmp_path: Path) -> None:
    """What DELETE /snapshots/{id} may remove without reading it: a manifest cut short or not
    JSON, not one that merely could not be read this time, nor a good one."""
    repo = SnapshotRepository(tmp_path / "repo")
    repo.put(_checkpoint("good", "snapshot"))
    (repo.manifests / "cut.json").write_text('{"id": "cut", "ki')
    (repo.manifests / "binary.json").write_bytes(b"\xff\xfe\x00")
    (repo.manifests / "alien.json").write_text("[1, 2]")
    (repo.manifests / "unreadable.json").mkdir()  # a read that fails (EISDIR here; EIO, EMFILE elsewhere)

    def damaged(cp_id: str) -> bool:
        try:
            repo.get(cp_id)
        except ManifestDamaged:
            return True
        except (SnapshotNotFound, SnapshotUnusable):
            return False
        return False

    assert [damaged(i) for i in ("good", "cut", "binary", "alien", "missing", "unreadable", "../x")] == \
        [False, True, True, True, False, False, False]


def test_freed_memory_layers_become_spare_files_whose_space_a_full_disk_gets_back(tmp_path: Path) -> None:
    """The gc keeps unreferenced memory layers as spares (storage/spares.py), not other layers;
    a repository short of space gives the spares' space back before it refuses a capture."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], check=True)
    try:
        repo = SnapshotRepository(mnt / "repo", spare_bytes=8 << 20)
        kept = _layer(repo, "mem-kept")
        repo.put(_checkpoint("c1", "snapshot", memory=(kept,)))
        _layer(repo, "mem-freed", b"f" * (6 << 20))
        _layer(repo, "dev-freed")
        assert sorted(repo.gc()) == ["dev-freed", "mem-freed"]
        assert sorted(p.name for p in repo.layers.iterdir()) == ["mem-kept"]
        assert repo.spares.total == 6 << 20
        filler = mnt / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # to ENOSPC
        repo.ensure_room()  # passes: the spare's 6 MiB were given back
        assert repo.spares.total == 0 and list((mnt / "repo" / "spare").iterdir()) == []
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / 'filler2'}", "bs=64k"], capture_output=True)
        with pytest.raises(DiskFull):
            repo.ensure_room()
        # on a disk this short, a freed layer is not kept: deleting must free space
        (mnt / "filler2").unlink()
        _layer(repo, "mem-freed2", b"f" * (1 << 20))
        assert repo.gc() == ["mem-freed2"] and repo.spares.total == 0
        assert list((mnt / "repo" / "spare").iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_two_starts_from_one_checkpoint_each_hold_its_layers(tmp_path: Path) -> None:
    """Creates from one snapshot at once pin the same Checkpoint object: the first to end must
    not unpin it for the other (it removed every entry of it before)."""
    orch = _orchestrator(tmp_path)
    orch.pinning = types.MethodType(Orchestrator.pinning, orch)
    cp = _checkpoint("c1", "snapshot", memory=(_layer(orch.repo, "mem-a"),))
    with orch.pinning(cp):
        with orch.pinning(cp):
            assert "mem-a" in orch.pins()
        assert "mem-a" in orch.pins(), "the other start still needs it"
    assert "mem-a" not in orch.pins()


def test_a_claimed_fork_memory_file_is_kept_and_an_unclaimed_one_collected(tmp_path: Path) -> None:
    """A fork's memory file goes once nothing maps or claims it, whatever else is in progress;
    one claimed (a fork starting its children, a wake) stays."""
    orch = _orchestrator(tmp_path)
    orch.claiming = types.MethodType(Orchestrator.claiming, orch)
    done, starting = orch.settings.mem_dir / "fork-done.mem", orch.settings.mem_dir / "fork-starting.mem"
    for f in (done, starting):
        f.write_bytes(b"\0" * 4096)
    with orch.claiming(starting):
        assert asyncio.run(orch.gc()) == [done.name]
        assert starting.exists()
    assert orch._claimed == {}
    assert asyncio.run(orch.gc()) == [starting.name]


def test_a_manifest_that_does_not_fit_is_a_disk_full_error_and_leaves_no_file(tmp_path: Path) -> None:
    """The check before a capture may pass and the disk fill up before its manifest is
    written: that is a 507 (DiskFull) like any full disk, not a bare OSError (500), and no
    half-written file is left in staging."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        repo = SnapshotRepository(mnt / "repo")
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / 'fill'}", "bs=64k"], capture_output=True)
        with pytest.raises(DiskFull, match="manifest of c1"):
            repo.put(_checkpoint("c1", "snapshot"))
        assert list(repo.staging.iterdir()) == [] and not (repo.manifests / "c1.json").exists()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_manifests_torn_by_a_host_crash_are_removed_at_start_and_no_longer_stop_the_gc(tmp_path: Path) -> None:
    """A pause's manifest is renamed into place without an fsync: after a power cut it can be
    empty (or NUL bytes). Unreadable, it stopped every gc for good; such manifests name
    nothing and go at start. A manifest with content that does not parse is kept (someone
    may want to look at it) and still stops the gc."""
    repo = SnapshotRepository(tmp_path / "repo")
    kept = _layer(repo, "disk-kept")
    _layer(repo, "disk-unused")
    repo.put(_checkpoint("good", "snapshot", disk=(kept,)))
    (repo.manifests / "empty.json").write_bytes(b"")
    (repo.manifests / "zeros.json").write_bytes(b"\0" * 300)
    with pytest.raises(StorageError):
        repo.gc()
    assert sorted(repo.remove_torn()) == ["empty.json", "zeros.json"]
    assert repo.gc() == ["disk-unused"]
    assert [cp.id for cp in repo.list()] == ["good"] and repo.layer_path("disk-kept").exists()
    (repo.manifests / "garbled.json").write_bytes(b'{"id": "garbled", "kind": ')
    assert repo.remove_torn() == []
    with pytest.raises(StorageError):
        repo.gc()
