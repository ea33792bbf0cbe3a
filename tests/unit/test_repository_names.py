"""Launchable checkpoints found by name (storage/repository.py): the newest of a name, renames
and deletes seen at once, and no re-reading of every manifest on each lookup."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agentenv.errors import SnapshotNotFound
from agentenv.storage import Checkpoint, SnapshotRepository


def checkpoint(cp_id: str, name: str | None, created_at: float, kind: str = "snapshot") -> Checkpoint:
    return Checkpoint(id=cp_id, kind=kind, template="base", base="/b", base_created_at=0.0, vcpus=1,
                      memory_mb=512, disk_mb=1024, memory=(), device=None, disk=(), name=name,
                      created_at=created_at)


def test_names_resolve_to_the_newest_launchable_checkpoint(tmp_path: Path) -> None:
    repo = SnapshotRepository(tmp_path)
    repo.put(checkpoint("a1", "env", 1.0))
    repo.put(checkpoint("p1", "env", 5.0, kind="pause"))  # not launchable
    assert repo.get("env").id == "a1"
    repo.put(checkpoint("a2", "env", 2.0))  # seen at once (same mtime tick or not)
    assert repo.get("env").id == "a2"
    repo.put(checkpoint("a2", None, 2.0))  # its name taken off
    assert repo.get("env").id == "a1"
    repo.delete("a1")
    with pytest.raises(SnapshotNotFound):
        repo.get("env")
    assert repo.get("a2").id == "a2"  # by id, always


def test_a_lookup_by_name_does_not_reread_every_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = SnapshotRepository(tmp_path)
    for i in range(200):
        repo.put(checkpoint(f"c{i}", f"n{i}", float(i)))
    assert repo.get("n7").id == "c7"
    reads = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda *a, **k: reads.append(1) or real(*a, **k))
    for i in range(50):
        assert repo.get(f"n{i}").id == f"c{i}"
    assert reads == []
    # nor after this node's own changes (a pause elsewhere, a delete): they update the index
    repo.put(checkpoint("p1", None, 1000.0, kind="pause"))
    repo.delete("c3")
    assert repo.get("n4").id == "c4" and [c.id for c in repo.list("pause")] == ["p1"]
    assert len(repo.list("snapshot")) == 199
    with pytest.raises(SnapshotNotFound):
        repo.get("n3")
    assert reads == []
    # A manifest written by another process (a node sharing the repository) is found too, once
    # the directory's mtime moved: the kernel stamps it from a clock that ticks every few ms.
    time.sleep(0.05)
    other = checkpoint("x1", "from-elsewhere", 999.0)
    (tmp_path / "manifests" / "x1.json").write_text(json.dumps(other.to_json()))
    assert repo.get("from-elsewhere").id == "x1"
