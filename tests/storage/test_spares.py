"""Spare layer files (storage/spares.py): freed memory layers kept for captures to write over."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentenv.storage.spares import SparePool, _local


def layer(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_a_freed_layer_is_kept_and_the_smallest_that_holds_a_layer_is_taken(tmp_path: Path) -> None:
    pool = SparePool(tmp_path / "spare", 16 << 20)
    for name, mib in (("a", 1), ("b", 4), ("c", 2)):
        src = layer(tmp_path / name, mib << 20)
        os.utime(src, (time.time() - 3600, time.time() - 3600))
        pool.offer(src)
        assert not src.exists()
    assert pool.total == 7 << 20
    out = tmp_path / "staging-mem"
    assert pool.take(out, (1 << 20) + 1)
    assert out.stat().st_size == 2 << 20, "the smallest spare that holds the layer"
    assert time.time() - out.stat().st_mtime < 60, "a taken spare is not an old staging leftover"
    assert pool.take(tmp_path / "big", 10 << 20)
    assert (tmp_path / "big").stat().st_size == 4 << 20, "none holds it: the largest"
    assert pool.take(tmp_path / "last", 1)
    assert not pool.take(tmp_path / "none", 1)
    assert list((tmp_path / "spare").iterdir()) == []


def test_a_file_still_open_or_mapped_elsewhere_is_not_kept(tmp_path: Path) -> None:
    """Its reader keeps the bytes it started on: the file is unlinked, not written over."""
    pool = SparePool(tmp_path / "spare", 16 << 20)
    for how in ("open(p, 'rb')",
                "m = mmap.mmap(os.open(p, os.O_RDONLY), 0, prot=mmap.PROT_READ)"):
        src = layer(tmp_path / "held", 1 << 20)
        reader = subprocess.Popen([sys.executable, "-c", f"import mmap, os, sys\np = {str(src)!r}\n"
                                   f"{'f = ' if how.startswith('open') else ''}{how}\nprint(1, flush=True)\n"
                                   "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert reader.stdout.readline().strip() == b"1"
            pool.offer(src)
        finally:
            reader.kill()
            reader.wait()
        assert not src.exists() and pool.total == 0 and list((tmp_path / "spare").iterdir()) == []
    src = layer(tmp_path / "mine", 1 << 20)
    with open(src, "rb"):  # this process's own open file counts too
        pool.offer(src)
    assert pool.total == 0


def test_the_pool_holds_at_most_its_size_and_gives_its_space_back(tmp_path: Path) -> None:
    pool = SparePool(tmp_path / "spare", 3 << 20)
    pool.offer(layer(tmp_path / "a", 2 << 20))
    pool.offer(layer(tmp_path / "b", 2 << 20))  # the oldest (a) goes to make room for it
    assert pool.total == 2 << 20 and not (tmp_path / "b").exists()
    pool.offer(layer(tmp_path / "c", 1 << 20))
    assert pool.total == 3 << 20
    pool.offer(layer(tmp_path / "d", 4 << 20))  # larger than the pool: not kept, nothing goes
    assert pool.total == 3 << 20 and not (tmp_path / "d").exists()
    assert pool.take(tmp_path / "first", 2 << 20) and (tmp_path / "first").read_bytes()[:1]
    assert pool.total == 1 << 20
    # the next start finds them, and a smaller setting trims them (largest first)
    again = SparePool(tmp_path / "spare", 1 << 20)
    assert again.total == 1 << 20
    assert sorted(p.stat().st_size for p in (tmp_path / "spare").iterdir()) == [1 << 20]
    assert again.clear() == 1 << 20 and again.total == 0
    assert list((tmp_path / "spare").iterdir()) == []
    off = SparePool(tmp_path / "off", 0)
    off.offer(layer(tmp_path / "d", 1 << 20))
    assert off.total == 0 and not (tmp_path / "d").exists()


def test_a_file_with_another_name_is_not_kept(tmp_path: Path) -> None:
    pool = SparePool(tmp_path / "spare", 16 << 20)
    src = layer(tmp_path / "a", 1 << 20)
    os.link(src, tmp_path / "other-name")  # opened later through this name, it would change under it
    pool.offer(src)
    assert pool.total == 0 and not src.exists()
    assert (tmp_path / "other-name").read_bytes()[:1] != b""


def test_an_open_while_the_lease_is_held_does_not_end_the_server(tmp_path: Path) -> None:
    """The kernel tells a lease holder of every open with SIGIO, whose default action ends the
    process: a pool turns it off (this test process would die here otherwise)."""
    SparePool(tmp_path / "spare", 16 << 20)
    assert signal.getsignal(signal.SIGIO) == signal.SIG_IGN
    src = layer(tmp_path / "a", 4096)
    fd = os.open(src, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        out = subprocess.run([sys.executable, "-c", f"import os\ntry:\n    os.open({str(src)!r}, os.O_RDONLY | "
                              "os.O_NONBLOCK)\nexcept BlockingIOError:\n    print('lease held')"],
                             capture_output=True, text=True, check=True).stdout
        assert out == "lease held\n"
        time.sleep(0.2)  # the signal has been delivered by now
    finally:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        os.close(fd)


def test_spares_are_kept_only_on_a_local_file_system(tmp_path: Path) -> None:
    assert _local(tmp_path) and not _local(Path("/proc/self"))
