"""A template snapshot's memory file brought back from its durable copy (after a host reboot
emptied tmpfs), and its completion mark, on the real file system."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentenv.storage import template_snapshot
from agentenv.storage.template_snapshot import TemplateSnapshot


def _snapshot(tmp_path: Path) -> TemplateSnapshot:
    d = tmp_path / "snap"
    d.mkdir()
    return TemplateSnapshot(template="base", dir=d, mem_file=tmp_path / "shm" / "base.mem", memory_mb=8, vcpus=1,
                            kernel="k", initramfs="i", rootfs="r", created_at=time.time())


def test_resumes_at_once_after_a_reboot_copy_the_memory_file_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Dozens of resumes right after a reboot each made their own copy on tmpfs (RAM that
    no admission counts) before one was linked in; now the first copies and the rest wait."""
    snap = _snapshot(tmp_path)
    pages = os.urandom(4096 * 64)
    snap.memory_copy.write_bytes(pages)
    copies: list[int] = []
    real = template_snapshot.materialize

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        copies.append(threading.get_ident())
        time.sleep(0.2)  # a copy takes a while: the other resumes arrive meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(template_snapshot, "materialize", counted)
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: snap.ensure_memory(), range(8)))
    assert len(copies) == 1
    assert snap.mem_file.read_bytes()[:len(pages)] == pages
    assert [p.name for p in snap.mem_file.parent.iterdir()] == ["base.mem"], "no copy left behind"


def test_the_completion_mark_is_written_whole(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    (snap.dir / "state").write_bytes(b"device state")
    (snap.dir / "disk.qcow2").write_bytes(b"qcow2")
    snap.memory_copy.write_bytes(b"\0" * 4096)
    snap.save()
    assert json.loads((snap.dir / "meta.json").read_text())["template"] == "base"
    assert not (snap.dir / "meta.json.tmp").exists()
    assert TemplateSnapshot.load(snap.dir) == snap
