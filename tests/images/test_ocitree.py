"""Making an unpacked image tree bootable (images/ocitree.py), on trees shaped as a hostile
image could ship them: what it edits stays inside the tree, and special files where the
account tables should be are refused at once instead of hanging or exhausting the server."""

from __future__ import annotations

import os
import stat
import threading
import tracemalloc
from pathlib import Path

import pytest

from agentenv.errors import InvalidRequest
from agentenv.images.ocitree import prepare_tree


def _tree(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    return root


def _prepare_within(root: Path, seconds: float) -> BaseException | None:
    """prepare_tree in a thread; fails the test if it has not returned within ``seconds``."""
    out: list[BaseException | None] = []

    def work() -> None:
        try:
            prepare_tree(root)
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 — handed to the test
            out.append(exc)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for fifo in root.rglob("*"):  # unblock a reader stuck on a FIFO before failing
            if stat.S_ISFIFO(os.lstat(fifo).st_mode):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"prepare_tree did not return within {seconds} s")
    return out[0]


def test_a_plain_tree_gets_the_user_account(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    (root / "etc" / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    assert _prepare_within(root, 10) is None
    assert "\nuser:x:1000:1000::/home/user:/bin/sh\n" in (root / "etc" / "passwd").read_text()
    assert (root / "etc" / "shadow").read_text().splitlines()[-1].startswith("user:*:")
    assert (root / "home" / "user").stat().st_uid == 1000
    for d in ("proc", "sys", "dev", "tmp", "run"):
        assert (root / d).is_dir()


@pytest.mark.parametrize("where", ["passwd", "shadow"])
def test_a_fifo_for_an_account_table_is_refused_at_once(tmp_path: Path, where: str) -> None:
    root = _tree(tmp_path / "t")
    (root / "etc" / where).unlink(missing_ok=True)
    os.mkfifo(root / "etc" / where)
    exc = _prepare_within(root, 10)
    assert isinstance(exc, InvalidRequest) and f"/etc/{where} is not a regular file" in exc.message


def test_a_device_for_an_account_table_is_refused_at_once(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    os.mknod(root / "etc" / "shadow", 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless
    exc = _prepare_within(root, 10)
    assert isinstance(exc, InvalidRequest) and "/etc/shadow is not a regular file" in exc.message


def test_a_link_to_a_huge_file_is_not_read_into_memory(tmp_path: Path) -> None:
    """/etc/resolv.conf and /etc/hosts are made regular files with the content they linked to;
    a link to a file of GiBs (or to a FIFO) gets the default content instead."""
    root = _tree(tmp_path / "t")
    with open(root / "big", "wb") as f:
        f.truncate(512 << 20)  # sparse: costs no disk, but 512 MiB to read
    os.mkfifo(root / "pipe")
    (root / "etc" / "resolv.conf").symlink_to("/big")
    (root / "etc" / "hosts").symlink_to("../pipe")
    tracemalloc.start()
    try:
        assert _prepare_within(root, 10) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak >> 20} MiB read"
    for name in ("resolv.conf", "hosts"):
        p = root / "etc" / name
        assert not p.is_symlink() and p.is_file() and p.stat().st_size < 4096, name


def test_symlinks_out_of_the_tree_are_followed_inside_it(tmp_path: Path) -> None:
    outside = tmp_path / "host-etc"
    outside.mkdir()
    (outside / "passwd").write_text("host:x:0:0::/:/bin/sh\n")
    root = tmp_path / "t"
    root.mkdir()
    (root / "etc").symlink_to(outside)  # absolute: resolves to <root>/<outside>, not the host's
    assert _prepare_within(root, 10) is None
    assert (outside / "passwd").read_text() == "host:x:0:0::/:/bin/sh\n"
    assert list(outside.iterdir()) == [outside / "passwd"]
    inside = root / str(outside).lstrip("/")
    assert "user:x:1000" in (inside / "passwd").read_text()


def test_what_interrupted_pulls_left_is_removed_at_start(tmp_path: Path) -> None:
    from agentenv.orchestrator.pulling import remove_interrupted

    images = tmp_path / "images"
    auth = images / "oci" / ".auth-x1"
    auth.mkdir(parents=True)
    (auth / "auth.json").write_text('{"auths": {"r": {"auth": "YWxpY2U6cHc="}}}')
    for d in (".pull-abc-1", ".unpack-2", ".drop-abc-3"):
        (images / "oci" / d / "rootfs").mkdir(parents=True)
    layout = images / "oci" / ("a" * 64)
    layout.mkdir()
    (images / "rootfs").mkdir()
    (images / "rootfs" / ".oci-x.ext4.unpack-2.partial").write_bytes(b"x")
    (images / "rootfs" / "oci-x.ext4").write_bytes(b"x")
    removed = remove_interrupted(images)
    assert len(removed) == 5
    assert sorted(p.name for p in (images / "oci").iterdir()) == [layout.name]  # a complete layout stays
    assert [p.name for p in (images / "rootfs").iterdir()] == ["oci-x.ext4"]
