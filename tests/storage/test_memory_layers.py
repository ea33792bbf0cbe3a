"""Memory layers against a real process: a child maps a file privately (as QEMU maps guest
RAM), writes pages, and the layer code copies them out and back in through the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.errors import DiskFull
from agentenv.storage import memory_layers as ml
from agentenv.storage.spares import SparePool

SIZE = 64 << 20
CHILD = r"""
import mmap, os, sys
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE)
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "write":       # write <page> <count> <byte>
        p, n, b = map(int, args)
        m[p * 4096:(p + n) * 4096] = bytes([b]) * (n * 4096)
    elif cmd == "read":      # read <page> -> first byte of the page
        p = int(args[0])
        print(m[p * 4096], flush=True)
        continue
    print("ok", flush=True)
"""


class Guest:
    def __init__(self, mem: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(mem)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def send(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def write(self, page: int, count: int, byte: int) -> None:
        assert self.send(f"write {page} {count} {byte}") == "ok"

    def read(self, page: int) -> int:
        return int(self.send(f"read {page}"))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[Path]:
    d = Path("/dev/shm") / f"aenv-test-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    f = d / "base.mem"
    with open(f, "wb") as fh:
        fh.truncate(SIZE)
        fh.seek(0)
        fh.write(b"\x07" * (1 << 20))  # the "template" touched its first MiB
    yield f
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def capture_of(mem: Path, out: Path, *writes: tuple[int, int, int]) -> ml.LayerInfo:
    """A layer captured from a fresh guest after ``writes`` (page, count, byte)."""
    g = Guest(mem)
    try:
        for page, count, byte in writes:
            g.write(page, count, byte)
        return ml.capture(g.proc.pid, mem, out)
    finally:
        g.close()


def test_capture_holds_only_the_changed_pages_and_restores_them(mem: Path, tmp_path: Path) -> None:
    g = Guest(mem)
    try:
        assert g.read(3) == 7 and g.read(5000) == 0  # both still the file's pages
        g.write(10, 3, 1)
        g.write(4000, 256, 2)  # 1 MiB
        layer = ml.capture(g.proc.pid, mem, tmp_path / "l1")
        assert layer.pages == 259
        assert layer.digest == ml.file_digest(layer.path)
    finally:
        g.close()
    g2 = Guest(mem)
    try:
        assert g2.read(10) == 7 and g2.read(4100) == 0
        assert ml.restore(g2.proc.pid, mem, [layer.path]) == 259
        assert (g2.read(10), g2.read(12), g2.read(13), g2.read(4255), g2.read(4256)) == (1, 1, 7, 2, 0)
        # After a restore every restored page is private again; the next layer holds only
        # the pages whose content changed since.
        g2.write(11, 1, 9)
        g2.write(9000, 1, 3)
        l2 = ml.capture(g2.proc.pid, mem, tmp_path / "l2", chain=[layer.path])
        assert l2.pages == 2
    finally:
        g2.close()
    g3 = Guest(mem)
    try:
        ml.restore(g3.proc.pid, mem, [layer.path, l2.path])
        assert (g3.read(10), g3.read(11), g3.read(4000), g3.read(9000)) == (1, 9, 2, 3)
    finally:
        g3.close()
    merged = ml.compact([layer.path, l2.path], tmp_path / "merged")
    assert merged.pages == 260
    g4 = Guest(mem)
    try:
        ml.restore(g4.proc.pid, mem, [merged.path])
        assert (g4.read(10), g4.read(11), g4.read(4000), g4.read(9000)) == (1, 9, 2, 3)
    finally:
        g4.close()


def test_a_torn_or_foreign_layer_is_refused(mem: Path, tmp_path: Path) -> None:
    g = Guest(mem)
    try:
        g.write(1, 1, 1)
        layer = ml.capture(g.proc.pid, mem, tmp_path / "l1")
        data = layer.path.read_bytes()
        (tmp_path / "torn").write_bytes(data[:-8])
        with pytest.raises(ml.StorageError, match="truncated"):
            ml.restore(g.proc.pid, mem, [tmp_path / "torn"])
        (tmp_path / "junk").write_bytes(b"x" * 8192)
        with pytest.raises(ml.StorageError, match="not a memory layer"):
            ml.restore(g.proc.pid, mem, [tmp_path / "junk"])
    finally:
        g.close()


def test_a_layer_no_longer_in_the_page_cache_restores_the_same(mem: Path, tmp_path: Path) -> None:
    """Uncached page data is read straight from the disk (direct I/O), cached data from the cache."""
    layer = capture_of(mem, tmp_path / "l1", (100, 300, 4), (7000, 5, 6))
    subprocess.run(["dd", f"of={layer.path}", "oflag=nocache", "conv=notrunc,fdatasync", "count=0"],
                   check=True, capture_output=True)  # drop the file's cached pages
    g2 = Guest(mem)
    try:
        assert ml.restore(g2.proc.pid, mem, [layer.path], [layer.digest]) == 305
        assert (g2.read(99), g2.read(100), g2.read(399), g2.read(400), g2.read(7004)) == (7, 4, 4, 0, 6)
    finally:
        g2.close()


def cached_bytes(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_an_uncached_capture_writes_the_same_layer_and_keeps_it_out_of_memory(
        mem: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause whose VM is parked writes its layer with direct I/O (not through the page cache),
    once the layer is large enough (here: whatever its size)."""
    monkeypatch.setattr(ml, "DIRECT_MIN_BYTES", 0)
    g = Guest(mem)
    try:
        g.write(100, 2048, 4)  # 8 MiB
        g.write(9000, 3, 5)
        cached = ml.capture(g.proc.pid, mem, tmp_path / "cached")
        direct = ml.capture(g.proc.pid, mem, tmp_path / "direct", uncached=True)
    finally:
        g.close()
    assert cached_bytes(direct.path) < 64 << 10 < (8 << 20) <= cached_bytes(cached.path), \
        "only the header and the runs table of an uncached layer go through the page cache"
    assert direct.pages == cached.pages == 2051
    assert direct.digest == cached.digest == ml.file_digest(direct.path)
    assert direct.path.read_bytes() == cached.path.read_bytes()
    g2 = Guest(mem)
    try:
        assert ml.restore(g2.proc.pid, mem, [direct.path], [direct.digest]) == 2051
        assert (g2.read(99), g2.read(100), g2.read(2147), g2.read(2148), g2.read(9002)) == (7, 4, 4, 0, 5)
    finally:
        g2.close()


def test_a_small_uncached_capture_goes_through_the_page_cache(mem: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Below DIRECT_MIN_BYTES of pages a parked pause's layer is copied into the page cache (the
    kernel writes it back): faster than the direct write for a small layer. At the limit it is
    written directly."""
    g = Guest(mem)
    try:
        g.write(100, 2048, 4)  # 8 MiB
        monkeypatch.setattr(ml, "DIRECT_MIN_BYTES", (2048 + 1) * 4096)
        small = ml.capture(g.proc.pid, mem, tmp_path / "small", uncached=True)
        monkeypatch.setattr(ml, "DIRECT_MIN_BYTES", 2048 * 4096)
        at_limit = ml.capture(g.proc.pid, mem, tmp_path / "at-limit", uncached=True)
    finally:
        g.close()
    assert small.pages == at_limit.pages == 2048 and small.digest == at_limit.digest
    assert cached_bytes(at_limit.path) < 64 << 10 < (8 << 20) <= cached_bytes(small.path)


def test_a_capture_over_a_spare_file_writes_the_same_layer(mem: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Written over a freed layer in place (storage/spares.py), larger than the new layer and
    full of other bytes, both ways of writing: the file ends as the layer a new file gets."""
    monkeypatch.setattr(ml, "DIRECT_MIN_BYTES", 0)
    spares = SparePool(tmp_path / "spare", 64 << 20)
    g = Guest(mem)
    try:
        g.write(100, 512, 4)  # 2 MiB
        g.write(9000, 3, 5)
        fresh = ml.capture(g.proc.pid, mem, tmp_path / "fresh")
        for uncached in (False, True):
            old = tmp_path / f"old-{uncached}"
            old.write_bytes(os.urandom(6 << 20))
            inode = old.stat().st_ino
            spares.offer(old)
            out = tmp_path / f"over-{uncached}"
            over = ml.capture(g.proc.pid, mem, out, uncached=uncached, spares=spares)
            assert out.stat().st_ino == inode and spares.total == 0, "written over the spare"
            assert over.digest == fresh.digest and over.size == out.stat().st_size == fresh.size
            assert out.read_bytes() == fresh.path.read_bytes()
    finally:
        g.close()
    g2 = Guest(mem)
    try:
        assert ml.restore(g2.proc.pid, mem, [out], [over.digest]) == 515
        assert (g2.read(99), g2.read(100), g2.read(611), g2.read(612), g2.read(9002)) == (7, 4, 4, 0, 5)
    finally:
        g2.close()


def test_a_capture_with_nothing_changed_since_its_chain_is_a_layer_that_restores(mem: Path, tmp_path: Path) -> None:
    """It was a 40-byte file whose header said 4096, refused as truncated (the first page is
    now written whole)."""
    first = capture_of(mem, tmp_path / "l1", (20, 4, 1))
    g = Guest(mem)
    try:
        ml.restore(g.proc.pid, mem, [first.path])
        empty = ml.capture(g.proc.pid, mem, tmp_path / "l2", chain=[first.path])
    finally:
        g.close()
    assert empty.pages == 0 and empty.path.stat().st_size == empty.size
    g2 = Guest(mem)
    try:
        ml.restore(g2.proc.pid, mem, [first.path, empty.path], [first.digest, empty.digest])
        assert (g2.read(19), g2.read(20), g2.read(23), g2.read(24)) == (7, 1, 1, 7)
    finally:
        g2.close()


def test_a_corrupt_layer_is_caught_while_it_is_restored(mem: Path, tmp_path: Path) -> None:
    layer = capture_of(mem, tmp_path / "l1", (20, 4, 1))
    data = bytearray(layer.path.read_bytes())
    data[4096 + 3 * 4096 + 17] ^= 0xFF  # a byte of the last page
    layer.path.write_bytes(bytes(data))
    g2 = Guest(mem)
    try:
        with pytest.raises(ml.CorruptLayer, match="fails its checksum"):
            ml.restore(g2.proc.pid, mem, [layer.path], [layer.digest])
        assert ml.restore(g2.proc.pid, mem, [layer.path]) == 4  # unchecked: the caller's choice
    finally:
        g2.close()


def test_a_layer_whose_runs_table_points_outside_the_ram_is_refused(mem: Path, tmp_path: Path) -> None:
    layer = capture_of(mem, tmp_path / "l1", (20, 4, 1))
    data = bytearray(layer.path.read_bytes())
    runs_at = 4096 + 4 * 4096
    data[runs_at:runs_at + 8] = (SIZE // 4096).to_bytes(8, "little")  # first page: past the end of RAM
    layer.path.write_bytes(bytes(data))
    g = Guest(mem)
    try:
        with pytest.raises(ml.CorruptLayer, match="fails its checksum"):
            ml.restore(g.proc.pid, mem, [layer.path], [layer.digest])
        with pytest.raises(ml.StorageError, match="inconsistent"):
            ml.restore(g.proc.pid, mem, [layer.path])
        assert g.read(20) == 7  # nothing was written
    finally:
        g.close()


def test_capture_speed_figure(mem: Path, tmp_path: Path) -> None:
    """Not a threshold (those live in the benchmark): prints the copy rate for the record."""
    g = Guest(mem)
    try:
        g.write(512, 5120, 5)  # 20 MiB
        t = time.perf_counter()
        layer = ml.capture(g.proc.pid, mem, tmp_path / "l1")
        dt = time.perf_counter() - t
        assert layer.pages == 5120
        print(f"capture 20 MiB: {dt * 1e3:.1f} ms")
    finally:
        g.close()


def test_materialized_file_is_base_plus_chain(mem: Path, tmp_path: Path) -> None:
    l1 = capture_of(mem, tmp_path / "l1", (10, 3, 1))
    out = mem.with_name("merged.mem")
    ml.materialize(mem, [l1.path], out)
    assert out.stat().st_size == mem.stat().st_size
    g2 = Guest(out)  # maps the materialized file copy-on-write: no page written into it
    try:
        assert (g2.read(3), g2.read(10), g2.read(12), g2.read(13), g2.read(5000)) == (7, 1, 1, 7, 0)
        s, e = ml.ram_mapping(g2.proc.pid, out)
        assert ml.private_runs(g2.proc.pid, s, e) == []
    finally:
        g2.close()
    # holes stay holes: only the base's data and the layer's pages take space
    assert out.stat().st_blocks * 512 < 4 << 20


def test_compacting_on_a_full_disk_is_disk_full_and_leaves_no_file(mem: Path, tmp_path: Path) -> None:
    """A pause that compacts its chain on a full disk is a 507 (DiskFull), which the
    orchestrator answers by giving the spare files' space back; it was a 500 with no retry."""
    l1 = capture_of(mem, tmp_path / "l1", (10, 256, 1))  # 1 MiB each
    l2 = capture_of(mem, tmp_path / "l2", (600, 256, 2))
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], check=True)
    try:
        with pytest.raises(DiskFull):
            ml.compact([l1.path, l2.path], full / "merged")
        assert list(full.iterdir()) == []
    finally:
        subprocess.run(["umount", str(full)], check=True)
