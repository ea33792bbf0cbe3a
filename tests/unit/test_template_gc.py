"""Template snapshots of superseded images are removed at start (they hold ~130 MiB of tmpfs
each), unless a checkpoint or a sandbox still needs them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agentenv.images import GuestArtifacts
from agentenv.orchestrator.templates import SnapshotBuilder, Template, TemplateCatalog
from agentenv.storage import TemplateSnapshot
from agentenv.vmm.accel import AccelInfo


def _snapshot(builder: SnapshotBuilder, d: Path, mem: Path) -> TemplateSnapshot:
    d.mkdir(parents=True)
    for name in ("disk.qcow2", "state"):
        (d / name).write_bytes(b"x")
    mem.write_bytes(b"m")
    snap = TemplateSnapshot(template="base", dir=d, mem_file=mem, memory_mb=512, vcpus=1, kernel="k",
                            initramfs="i", rootfs="r", created_at=1.0)
    snap.save()
    return snap


def test_stale_template_snapshots_are_removed_unless_kept(tmp_path: Path) -> None:
    root, mem_dir = tmp_path / "templates", tmp_path / "mem"
    mem_dir.mkdir()
    catalog = TemplateCatalog(root)
    new = Template("base", GuestArtifacts(Path("/k"), Path("/i"), Path("/r-new"), Path("/t")))
    old = Template("base", GuestArtifacts(Path("/k"), Path("/i"), Path("/r-old"), Path("/t")))
    catalog.put(new)
    builder = SnapshotBuilder(root=root, mem_dir=mem_dir, sock_dir=tmp_path, slots=None,  # type: ignore[arg-type]
                              accel=AccelInfo("tcg", "test"), boot_timeout_s=1, tb_size_mb=32)
    current = _snapshot(builder, builder.snapshot_dir(new, 1, 512), mem_dir / "cur.mem")
    current_big = _snapshot(builder, builder.snapshot_dir(new, 2, 1024), mem_dir / "cur2.mem")
    stale = _snapshot(builder, builder.snapshot_dir(old, 1, 512), mem_dir / "old.mem")
    pinned = _snapshot(builder, builder.snapshot_dir(old, 1, 1024), mem_dir / "pinned.mem")
    mapped = _snapshot(builder, builder.snapshot_dir(old, 2, 512), mem_dir / "mapped.mem")
    (mem_dir / "orphan.mem").write_bytes(b"o")

    removed = asyncio.run(builder.remove_stale(catalog, lambda: {str(pinned.dir), str(mapped.mem_file)}))

    assert set(removed) == {str(stale.dir), str(mem_dir / "orphan.mem")}
    assert not stale.dir.exists() and not stale.mem_file.exists()
    for kept in (current, current_big, pinned, mapped):
        assert TemplateSnapshot.load(kept.dir) is not None
    assert sorted(p.name for p in mem_dir.iterdir()) == ["cur.mem", "cur2.mem", "mapped.mem", "pinned.mem"]
    assert [p.name for p in root.iterdir()] == ["base"]  # nothing left in the trash


def _setup(tmp_path: Path) -> tuple[SnapshotBuilder, TemplateCatalog, Template, Path]:
    root, mem_dir = tmp_path / "templates", tmp_path / "mem"
    mem_dir.mkdir()
    catalog = TemplateCatalog(root)
    catalog.put(Template("base", GuestArtifacts(Path("/k"), Path("/i"), Path("/r-new"), Path("/t"))))
    old = Template("base", GuestArtifacts(Path("/k"), Path("/i"), Path("/r-old"), Path("/t")))
    builder = SnapshotBuilder(root=root, mem_dir=mem_dir, sock_dir=tmp_path, slots=None,  # type: ignore[arg-type]
                              accel=AccelInfo("tcg", "test"), boot_timeout_s=1, tb_size_mb=32)
    return builder, catalog, old, mem_dir


def test_a_snapshot_being_built_or_looked_up_is_not_removed(tmp_path: Path) -> None:
    """A template updated while a create of its old version builds (or loads) that version's
    snapshot: the build's memory file has no meta.json yet, and looks like a crash's leftover."""
    builder, catalog, old, mem_dir = _setup(tmp_path)
    d = builder.snapshot_dir(old, 1, 512)
    d.mkdir(parents=True)
    building_mem = mem_dir / f"base-{d.name}.mem"  # what SnapshotBuilder._build names it
    building_mem.write_bytes(b"m")
    loaded = _snapshot(builder, builder.snapshot_dir(old, 1, 1024), mem_dir / "loaded.mem")

    async def main() -> list[str]:
        builder._locks[d] = asyncio.Lock()
        builder._locks[loaded.dir] = asyncio.Lock()
        async with builder._locks[d], builder._locks[loaded.dir]:
            return await builder.remove_stale(catalog, set)

    assert asyncio.run(main()) == []
    assert building_mem.exists() and d.exists() and TemplateSnapshot.load(loaded.dir) is not None


def test_a_claim_taken_while_the_files_are_scanned_is_honoured(tmp_path: Path) -> None:
    """What is in use is asked for after the scan (a thread), on the event loop, right before
    the removal: a create that claimed the snapshot meanwhile keeps it."""
    builder, catalog, old, mem_dir = _setup(tmp_path)
    claimed = _snapshot(builder, builder.snapshot_dir(old, 1, 512), mem_dir / "claimed.mem")
    unclaimed = _snapshot(builder, builder.snapshot_dir(old, 1, 1024), mem_dir / "unclaimed.mem")
    claims: set[str] = set()

    async def main() -> list[str]:
        removal = asyncio.create_task(builder.remove_stale(catalog, lambda: set(claims)))
        await asyncio.sleep(0)  # the removal has started its scan
        claims.update({str(claimed.dir), str(claimed.mem_file)})  # as Orchestrator.claiming does
        return await removal

    assert asyncio.run(main()) == [str(unclaimed.dir)]
    assert TemplateSnapshot.load(claimed.dir) is not None and claimed.mem_file.exists()
    assert not unclaimed.dir.exists() and not unclaimed.mem_file.exists()


def test_a_cpu_model_change_makes_a_new_snapshot_and_old_ones_keep_theirs(tmp_path: Path) -> None:
    """The TCG CPU model is part of a snapshot's identity: with another AENV_TCG_CPU the next
    create builds a new one (the old one goes once unused), and a snapshot written before the
    model was recorded is restored with the model it was made with, "max"."""
    t = Template("base", GuestArtifacts(Path("/k"), Path("/i"), Path("/r"), Path("/t")))
    tcg = AccelInfo("tcg", "test")

    def builder(cpu: str, accel: AccelInfo = tcg) -> SnapshotBuilder:
        return SnapshotBuilder(root=tmp_path, mem_dir=tmp_path, sock_dir=tmp_path, slots=None,  # type: ignore[arg-type]
                               accel=accel, boot_timeout_s=1, tb_size_mb=32, tcg_cpu=cpu)

    assert builder("max").snapshot_dir(t, 1, 512) != builder("max,-erms").snapshot_dir(t, 1, 512)
    kvm = AccelInfo("kvm", "test")  # the guest gets the host's CPU: the TCG model is irrelevant
    assert builder("max", kvm).snapshot_dir(t, 1, 512) == builder("max,-erms", kvm).snapshot_dir(t, 1, 512)

    old = _snapshot(builder("max"), tmp_path / "old", tmp_path / "old.mem")
    meta = old.dir / "meta.json"
    fields = json.loads(meta.read_text())
    del fields["tcg_cpu"]  # as written before the field existed
    meta.write_text(json.dumps(fields))
    loaded = TemplateSnapshot.load(old.dir)
    assert loaded is not None and loaded.tcg_cpu == "max"


def test_puts_of_one_template_name_at_once_each_publish_a_whole_definition(tmp_path: Path) -> None:
    """Two pulls under one name write its definition at the same moment: each put must land
    whole (before, both wrote one tmp file: torn JSON, or a rename of a file already moved)."""
    import threading

    catalog = TemplateCatalog(tmp_path)
    defs = [Template("t", GuestArtifacts(Path("/k"), Path("/i"), Path(f"/r{i}" * 400), Path("/t"))) for i in range(2)]
    errors: list[BaseException] = []

    def writer(t: Template) -> None:
        try:
            for _ in range(300):
                catalog.put(t)
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(defs[i % 2],)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert catalog.get("t") in defs
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["template.json"]
