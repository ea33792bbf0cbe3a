"""qcow2 overlays are made by qemu-img on tmpfs and copied into place (storage/overlays.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from agentenv.errors import StorageError
from agentenv.storage import overlays
from agentenv.storage.overlays import backing_chain, create_overlay, create_overlay_over


def _info(path: Path) -> dict:
    out = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_overlays_are_valid_qcow2_over_their_backing_and_leave_no_staging(tmp_path: Path) -> None:
    staged_before = set(overlays.STAGING.glob("aenv-qcow2-*"))
    base = tmp_path / "base.raw"
    base.write_bytes(b"\0" * (1 << 20))
    asyncio.run(create_overlay(tmp_path / "top.qcow2", base, "raw"))
    info = _info(tmp_path / "top.qcow2")
    assert (info["format"], info["backing-filename"], info["virtual-size"]) == ("qcow2", str(base), 1 << 20)
    # Over a layer that is not there yet (a snapshot's stop window names it first).
    asyncio.run(create_overlay_over(tmp_path / "next.qcow2", tmp_path / "sealed.qcow2", 64))
    assert backing_chain(tmp_path / "next.qcow2") == [tmp_path / "sealed.qcow2"]
    assert _info(tmp_path / "next.qcow2")["virtual-size"] == 64 << 20
    assert set(overlays.STAGING.glob("aenv-qcow2-*")) == staged_before


def test_a_chain_that_cannot_be_read_is_an_error_not_an_empty_chain(tmp_path: Path) -> None:
    """The gc keeps what the chains under live overlays name: a chain it could not read must
    stop it, not read as "no layers" (which it would collect). A missing file ends a chain."""
    base = tmp_path / "base.raw"
    base.write_bytes(b"\0" * (1 << 20))
    asyncio.run(create_overlay(tmp_path / "mid.qcow2", base, "raw"))
    asyncio.run(create_overlay_over(tmp_path / "top.qcow2", tmp_path / "mid.qcow2", 1))
    assert backing_chain(tmp_path / "top.qcow2") == [tmp_path / "mid.qcow2", base]
    assert backing_chain(tmp_path / "gone.qcow2") == []
    (tmp_path / "mid.qcow2").unlink()
    (tmp_path / "mid.qcow2").mkdir()  # there, but not readable as a file (EISDIR, as an EIO would be)
    with pytest.raises(StorageError, match="cannot be read"):
        backing_chain(tmp_path / "top.qcow2")


def test_a_failed_create_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(StorageError):  # the backing file must exist without -u
        asyncio.run(create_overlay(tmp_path / "top.qcow2", tmp_path / "missing.raw", "raw"))
    assert list(tmp_path.iterdir()) == []


def test_staging_folders_of_killed_creates_are_swept_and_live_ones_kept() -> None:
    import os
    import tempfile
    import time

    old = Path(tempfile.mkdtemp(prefix="aenv-qcow2-", dir=overlays.STAGING))
    (old / "disk.qcow2").write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    fresh = Path(tempfile.mkdtemp(prefix="aenv-qcow2-", dir=overlays.STAGING))
    try:
        removed = overlays.remove_stale_staging()
        assert str(old) in removed and not old.exists()
        assert str(fresh) not in removed and fresh.exists()
    finally:
        for d in (old, fresh):
            subprocess.run(["rm", "-rf", str(d)], check=True)
