"""Memory layers: the guest RAM pages a sandbox changed, copied out of its QEMU process.

A sandbox's RAM is a private (copy-on-write) mapping of its template's memory file, so the
pages it changed are exactly the *anonymous* pages of that mapping; untouched pages are still
the file's page-cache pages. The kernel lists them for us (``PAGEMAP_SCAN`` on
``/proc/PID/pagemap``, Linux ≥ 6.7, with a plain pagemap read as the fallback) as coalesced
page ranges, and ``process_vm_readv`` copies them out in bulk. Restoring is the reverse:
``process_vm_writev`` of every layer's pages into a new QEMU's mapping before its device state
is loaded (qemu-microvm-notes.md §8).

A layer file is written in one pass as ``header | page data | runs``:

    0       header: magic "AENVMEM1", page size, mapping size in bytes, run count,
            offset of the runs table (5 × u64), padded to one page; written last
    4096    the pages of all runs, in order (page-aligned, so the file maps cleanly)
    runs    (first page index, page count) per run (2 × u64 each)

Its checksum (xxh3-128, also its content address) covers the bytes from offset 4096 to the end,
then the header.

Layers stack: base memory file → L1 → L2 … A later layer's page wins. After a resume every
restored page is private again, so a capture *compares* what it finds with the chain it came
from and writes only pages whose content changed: storage stays incremental even though
the kernel cannot tell us what was written since the resume (no soft-dirty on these hosts).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

from agentenv.errors import DiskFull, StorageError
from agentenv.storage.spares import SparePool

PAGE = 4096
MAGIC = b"AENVMEM1"
_HEADER = struct.Struct("<8sQQQQ")
_RUN = struct.Struct("<QQ")
_CHUNK = 4 << 20  # copy buffer: bounded memory whatever the layer size
_IOV_MAX = 1024
# An uncached capture smaller than this goes through the page cache all the same (capture()).
DIRECT_MIN_BYTES = 32 << 20

# PAGEMAP_SCAN (linux/fs.h): categories and the ioctl number _IOWR('f', 16, struct pm_scan_arg)
_PAGE_IS_FILE = 1 << 2
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_SWAPPED = 1 << 4
_PAGEMAP_SCAN = 0xC0606610


class _PmScanArg(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_writev.restype = ctypes.c_ssize_t
for _f in (_libc.process_vm_readv, _libc.process_vm_writev):
    _f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                   ctypes.c_ulong, ctypes.c_ulong]


Run = tuple[int, int]  # (first page index, page count) within the RAM mapping


@dataclass(frozen=True)
class LayerInfo:
    """What a capture wrote: its checksum (xxh3-128 of the file, also its content address),
    size and how many pages it holds."""

    path: Path
    digest: str
    size: int
    pages: int


# -- finding the pages ---------------------------------------------------------------------


def ram_mapping(pid: int, mem_path: Path) -> tuple[int, int]:
    """Start and end address of QEMU's private mapping of ``mem_path`` (the guest RAM)."""
    target = str(mem_path)
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == target and parts[1].startswith("rw"):
                    lo, hi = parts[0].split("-")
                    return int(lo, 16), int(hi, 16)
    except OSError as exc:
        raise StorageError(f"cannot read the memory map of QEMU {pid}: {exc}") from exc
    raise StorageError(f"QEMU {pid} has no writable mapping of {target}")


def private_runs(pid: int, start: int, end: int) -> list[Run]:
    """The changed (anonymous: present or swapped, not file-backed) pages of [start, end)."""
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        try:
            return _scan_ioctl(fd, start, end)
        except OSError:
            return _scan_pagemap(fd, start, end)  # kernel without PAGEMAP_SCAN
    finally:
        os.close(fd)


def _scan_ioctl(fd: int, start: int, end: int) -> list[Run]:
    vec = (_PageRegion * 4096)()
    runs: list[Run] = []
    addr = start
    while addr < end:
        arg = _PmScanArg(size=ctypes.sizeof(_PmScanArg), start=addr, end=end,
                         vec=ctypes.addressof(vec), vec_len=len(vec),
                         category_inverted=_PAGE_IS_FILE, category_mask=_PAGE_IS_FILE,
                         category_anyof_mask=_PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
                         return_mask=_PAGE_IS_FILE)
        n = fcntl.ioctl(fd, _PAGEMAP_SCAN, arg)
        for r in vec[:n]:
            first, count = (r.start - start) // PAGE, (r.end - r.start) // PAGE
            if runs and runs[-1][0] + runs[-1][1] == first:
                runs[-1] = (runs[-1][0], runs[-1][1] + count)
            else:
                runs.append((first, count))
        if arg.walk_end <= addr or n < len(vec):
            break
        addr = arg.walk_end
    return runs


def _scan_pagemap(fd: int, start: int, end: int) -> list[Run]:
    npages = (end - start) // PAGE
    data = os.pread(fd, npages * 8, (start // PAGE) * 8)
    runs: list[Run] = []
    for i, (e,) in enumerate(struct.iter_unpack("<Q", data)):
        if (e >> 62) & 3 and not (e >> 61) & 1:  # present or swapped, not file/shared
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


# -- moving pages in and out of a process -----------------------------------------------------


def _transfer(fn: ctypes._CFuncPtr, pid: int, local: Sequence[tuple[int, int]],
              remote: Sequence[tuple[int, int]]) -> None:
    """One process_vm_{read,write}v over matching lists of (address, length)."""
    total = sum(n for _, n in remote)
    lv = (_IoVec * len(local))(*[_IoVec(a, n) for a, n in local])
    rv = (_IoVec * len(remote))(*[_IoVec(a, n) for a, n in remote])
    done = fn(pid, lv, len(local), rv, len(remote), 0)
    if done != total:
        err = ctypes.get_errno()
        raise StorageError(f"copying guest memory of QEMU {pid} failed after {max(done, 0)} of {total} "
                           f"bytes: {os.strerror(err) if err else 'short transfer'}")


def _pieces(runs: Sequence[Run], chunk_pages: int) -> Iterator[list[Run]]:
    """Split runs into batches of at most ``chunk_pages`` pages and _IOV_MAX runs."""
    batch: list[Run] = []
    room = chunk_pages
    for first, count in runs:
        while count:
            take = min(count, room)
            batch.append((first, take))
            first, count, room = first + take, count - take, room - take
            if room == 0 or len(batch) == _IOV_MAX:
                yield batch
                batch, room = [], chunk_pages
    if batch:
        yield batch


# -- layers -------------------------------------------------------------------------------------


class LayerFile:
    """A sealed layer, mapped read-only: its runs and a view of its page data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError as exc:  # empty file
                raise StorageError(f"memory layer {path.name} is empty") from exc
        if len(self._map) < PAGE:
            raise StorageError(f"memory layer {path.name} is truncated")
        magic, page, self.mapping_size, nruns, runs_at = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or page != PAGE:
            raise StorageError(f"{path.name} is not a memory layer")
        if runs_at + nruns * _RUN.size != len(self._map):
            raise StorageError(f"memory layer {path.name} is truncated")
        self.runs: list[Run] = [_RUN.unpack_from(self._map, runs_at + i * _RUN.size) for i in range(nruns)]
        self.data_offset = PAGE
        self.runs_at = runs_at
        self.pages = sum(c for _, c in self.runs)
        ram_pages = self.mapping_size // PAGE
        if PAGE + self.pages * PAGE != runs_at or any(f + c > ram_pages for f, c in self.runs):
            raise StorageError(f"memory layer {path.name} is inconsistent")  # never outside the RAM
        self._view = memoryview(self._map)

    def close(self) -> None:
        """Unmap. Every view of the data handed out must be dropped before."""
        self._view.release()
        self._map.close()

    def view(self) -> memoryview:
        return self._view


class _Chain:
    """The newest version of every page a chain of layers holds, as numpy arrays over the
    mapped layer files: sorted page numbers, and for each the layer and row holding it."""

    def __init__(self, layers: Sequence[LayerFile]) -> None:
        self.rows = [np.frombuffer(layer.view(), dtype=np.uint64, offset=PAGE, count=layer.pages * PAGE // 8)
                     .reshape(-1, PAGE // 8) for layer in layers]
        pages, which, row = [], [], []
        for i, layer in enumerate(layers):
            idx = _page_numbers(layer.runs)
            pages.append(idx)
            which.append(np.full(len(idx), i, dtype=np.int32))
            row.append(np.arange(len(idx), dtype=np.int64))
        if pages:
            # newest first, so np.unique's first occurrence is the newest version
            all_pages = np.concatenate(pages[::-1])
            self.pages, first = np.unique(all_pages, return_index=True)
            self.layer = np.concatenate(which[::-1])[first]
            self.row = np.concatenate(row[::-1])[first]
        else:
            self.pages = np.zeros(0, dtype=np.int64)
            self.layer = np.zeros(0, dtype=np.int32)
            self.row = np.zeros(0, dtype=np.int64)

    def changed(self, page_numbers: np.ndarray, data: np.ndarray) -> np.ndarray:
        """Mask of the pages in ``data`` (rows of uint64) that differ from the chain's."""
        out = np.ones(len(page_numbers), dtype=bool)
        if not len(self.pages):
            return out
        pos = np.searchsorted(self.pages, page_numbers)
        pos_c = np.minimum(pos, len(self.pages) - 1)
        found = self.pages[pos_c] == page_numbers
        for i, rows in enumerate(self.rows):
            mask = found & (self.layer[pos_c] == i)
            if mask.any():
                out[mask] = (rows[self.row[pos_c[mask]]] != data[mask]).any(axis=1)
        return out

    def release(self) -> None:
        self.rows.clear()


def _page_numbers(runs: Sequence[Run]) -> np.ndarray:
    if not runs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(f, f + c, dtype=np.int64) for f, c in runs])


def _runs_of(pages: np.ndarray) -> list[Run]:
    """Coalesce sorted page numbers into runs."""
    if not len(pages):
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return [(int(pages[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def capture(pid: int, mem_path: Path, out: Path, chain: Sequence[Path] = (), *, uncached: bool = False,
            spares: SparePool | None = None) -> LayerInfo:
    """Write the changed pages of QEMU ``pid``'s RAM to ``out`` (the VM must be stopped).

    With a ``chain`` (the layers this sandbox was restored from, oldest first), pages whose
    content equals what the chain already holds are left out. Runs in a worker thread; a full
    disk raises DiskFull and leaves no file.

    ``uncached``: a layer nobody reads soon (a pause whose VM is parked). Its pages go to the
    disk with direct I/O instead of through the page cache once they come to DIRECT_MIN_BYTES
    (counted before the comparison with a ``chain``: after a restore every restored page is
    private, so a sandbox that was resumed cold counts its whole restored state).
    On a virtualised host every fresh page-cache page costs a hypervisor fault, so a cached
    write of 200 MiB takes from 150 to 420 ms depending on how much recently freed memory the
    kernel has at hand; direct I/O is steady and leaves no copy in RAM, and a restore then
    reads it from the disk. A small layer is the other way round: copied into the page cache,
    the call returns before the disk has it (the kernel writes it back), and 20 MiB took about
    half the time of the direct write (docs/mechanisms/checkpoints.md).

    ``spares``: the layer is written over a spare file when there is one (storage/spares.py).
    Not after a restore (with a ``chain``): every restored page is private then, and the few
    that changed are no guide to the size. A full disk gets the spares' space back, and the
    layer is written once more into it.
    """
    start, end = ram_mapping(pid, mem_path)
    runs = private_runs(pid, start, end)
    page_bytes = sum(c for _, c in runs) * PAGE
    if spares is not None and not chain:
        spares.take(out, PAGE + page_bytes + len(runs) * _RUN.size)
    direct = uncached and page_bytes >= DIRECT_MIN_BYTES
    layers = [LayerFile(p) for p in chain]
    index = _Chain(layers) if layers else None
    try:
        for attempt in range(2):
            try:
                return _write_layer(pid, start, end - start, runs, out, index, direct)
            except OSError as exc:
                out.unlink(missing_ok=True)
                if exc.errno == errno.ENOSPC:
                    if attempt == 0 and spares is not None and spares.clear():
                        continue
                    raise DiskFull(f"no space left on {out.parent} for the memory layer; free disk space") from exc
                raise StorageError(f"cannot write memory layer {out}: {exc}") from exc
        raise AssertionError("unreachable")
    finally:
        if index is not None:
            index.release()
        del index
        for layer in layers:
            layer.close()


def _write_layer(pid: int, start: int, size: int, runs: list[Run], out: Path, chain: _Chain | None,
                 uncached: bool) -> LayerInfo:
    """Copy out of QEMU into one buffer while the previous buffer is written (a two-stage
    pipeline: both copies release the GIL, and the VM is stopped, so its CPU is free)."""
    pair = _buffers()
    try:
        return _pipeline(pid, start, size, runs, out, chain, pair, uncached)
    finally:
        _release_buffers(pair)


_spare: list[list[tuple[mmap.mmap, int]]] = []


def _buffers() -> list[tuple[mmap.mmap, int]]:
    """Two page-aligned copy buffers (direct I/O needs the alignment), kept between captures:
    a fresh buffer costs a page fault per page on first use, which on a virtualised host is
    as slow as the copy itself."""
    try:
        return _spare.pop()
    except IndexError:
        out = []
        for _ in range(2):
            b = mmap.mmap(-1, _CHUNK)
            b.write(b"\1" * _CHUNK)  # touched now, not during a pause
            out.append((b, ctypes.addressof(ctypes.c_char.from_buffer(b))))
        return out


def warm_buffers() -> None:
    """Make a pair ahead of the first capture or restore (at server start), which would
    otherwise pay for touching it: about 9 ms on the development machine."""
    if not _spare:
        _release_buffers(_buffers())


def _release_buffers(pair: list[tuple[mmap.mmap, int]]) -> None:
    """Keep a pair for the next capture or restore; beyond two, give the memory back (a burst
    of concurrent operations must not pin its buffers for the life of the server)."""
    if len(_spare) < 2:
        _spare.append(pair)


class _PageWriter:
    """Appends page data at page-aligned offsets from PAGE on: with direct I/O when asked and
    the file system takes it (the buffers are page-aligned), else through ``f``."""

    def __init__(self, f: BinaryIO, path: Path, direct: bool) -> None:
        self.f = f
        self.pos = PAGE
        self.fd: int | None = None
        f.seek(PAGE)
        if direct:
            try:
                self.fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise

    def write(self, data: memoryview) -> None:
        if self.fd is not None:
            try:
                n = os.pwrite(self.fd, data, self.pos)
                if n == len(data):
                    self.pos += n
                    return
                data = data[n:]  # a short write: the rest through the cache
                self.pos += n
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            self.close()
            self.f.seek(self.pos)
        self.f.write(data)
        self.pos += len(data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pipeline(pid: int, start: int, size: int, runs: list[Run], out: Path, chain: _Chain | None,
              pair: list[tuple[mmap.mmap, int]], uncached: bool) -> LayerInfo:
    kept: list[np.ndarray] = []
    digest = xxhash.xxh3_128()

    with open(out, "r+b" if out.exists() else "wb") as f:  # over a spare file, in place
        pages = _PageWriter(f, out, uncached)
        try:
            def emit(data: memoryview) -> None:
                pages.write(data)
                digest.update(data)

            with ThreadPoolExecutor(1) as writer:  # its exit waits for the last write
                pending: Future[None] | None = None
                for i, batch in enumerate(_pieces(runs, _CHUNK // PAGE)):
                    buf, addr = pair[i % 2]
                    nbytes = sum(c for _, c in batch) * PAGE
                    _transfer(_libc.process_vm_readv, pid, [(addr, nbytes)],
                              [(start + first * PAGE, count * PAGE) for first, count in batch])
                    if pending is not None:
                        pending.result()
                    numbers = _page_numbers(batch)
                    if chain is not None:  # keep only the changed pages, moved to the buffer's front
                        data = np.frombuffer(buf, dtype=np.uint64, count=nbytes // 8).reshape(-1, PAGE // 8)
                        mask = chain.changed(numbers, data)
                        numbers = numbers[mask]
                        data[:len(numbers)] = data[mask]
                        nbytes = len(numbers) * PAGE
                        del data
                    kept.append(numbers)
                    pending = writer.submit(emit, memoryview(buf)[:nbytes])
                if pending is not None:
                    pending.result()
        finally:
            pages.close()
        f.seek(pages.pos)
        numbers = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
        info = _seal(f, digest, size, _runs_of(numbers), out)
        f.truncate(info.size)  # what is left of a spare's old bytes
        return info


def _seal(f: BinaryIO, digest: xxhash.xxh3_128, size: int, runs: list[Run], out: Path) -> LayerInfo:
    """Append the runs table, then write the header (last, so a torn file never parses)."""
    runs_at = f.tell()
    table = b"".join(_RUN.pack(*r) for r in runs)
    f.write(table)
    digest.update(table)
    head = _HEADER.pack(MAGIC, PAGE, size, len(runs), runs_at)
    digest.update(head)
    f.seek(0)
    f.write(head.ljust(PAGE, b"\0"))  # the whole first page: over a spare file, no old bytes stay
    return LayerInfo(out, digest.hexdigest(), runs_at + len(table), sum(c for _, c in runs))


def _merge(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for first, count in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((first, count))
    return out


class CorruptLayer(StorageError):
    """A layer's bytes do not match the checksum recorded for it."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"memory layer {path.name} fails its checksum (corrupt)")
        self.path = path


def restore(pid: int, mem_path: Path, chain: Sequence[Path], digests: Sequence[str | None] = ()) -> int:
    """Write every layer's pages into QEMU ``pid``'s RAM, oldest first (a later page wins).
    Must run before the device state is loaded. Returns the number of pages written.

    ``digests`` (one per layer, None to skip): each layer is checked against its checksum in
    the same pass that copies it, so a restore reads a layer once; on a mismatch it raises
    CorruptLayer, and the caller must discard the machine (its RAM holds corrupt pages)."""
    if digests and len(digests) != len(chain):
        raise ValueError(f"{len(digests)} checksums for {len(chain)} memory layers")
    start, end = ram_mapping(pid, mem_path)
    written = 0
    pair = _buffers()
    try:
        with ThreadPoolExecutor(1) as reader:
            for i, path in enumerate(chain):
                digest = digests[i] if digests else None
                try:
                    written += _restore_layer(pid, start, end - start, path, digest, pair, reader)
                except CorruptLayer:
                    raise
                except StorageError:
                    # A layer that does not parse, or names pages outside the RAM, is corrupt if
                    # its bytes are not the ones recorded (the header and runs table are hashed too).
                    if digest is not None and file_digest(path) != digest:
                        raise CorruptLayer(path) from None
                    raise
    finally:
        _release_buffers(pair)
    return written


def _restore_layer(pid: int, start: int, size: int, path: Path, digest: str | None,
                   pair: list[tuple[mmap.mmap, int]], reader: ThreadPoolExecutor) -> int:
    """One layer: the next batch is read (and hashed) while the previous one is written."""
    layer = LayerFile(path)
    src = _LayerReader(path)
    pending: Future[None] | None = None
    try:
        if layer.mapping_size != size:
            raise StorageError(f"memory layer {path.name} is for {layer.mapping_size >> 20} MiB of RAM, "
                               f"the machine has {size >> 20} MiB")
        h = xxhash.xxh3_128() if digest else None
        batches = list(_pieces(layer.runs, _CHUNK // PAGE))
        sizes = [sum(c for _, c in b) * PAGE for b in batches]

        def fetch(k: int, offset: int) -> None:
            view = memoryview(pair[k % 2][0])[:sizes[k]]
            src.read(view, offset)
            if h is not None:
                h.update(view)

        off = layer.data_offset
        pending = reader.submit(fetch, 0, off) if batches else None
        for k, batch in enumerate(batches):
            assert pending is not None
            done, pending = pending, None
            done.result()
            if k + 1 < len(batches):
                pending = reader.submit(fetch, k + 1, off + sizes[k])
            _transfer(_libc.process_vm_writev, pid, [(pair[k % 2][1], sizes[k])],
                      [(start + f * PAGE, c * PAGE) for f, c in batch])
            off += sizes[k]
        if h is not None:
            h.update(layer.view()[layer.runs_at:])
            h.update(layer.view()[:_HEADER.size])
            if h.hexdigest() != digest:
                raise CorruptLayer(path)
        return layer.pages
    finally:
        if pending is not None:  # a read still running (the copy into QEMU failed): let it end
            wait([pending])
        src.close()
        layer.close()


class _LayerReader:
    """Reads page data into aligned buffers: from the page cache where the pages are cached,
    straight from the disk where not (a layer evicted from the cache, or on disk since before a
    restart: reading it through the cache would allocate a fresh page for every page read)."""

    def __init__(self, path: Path) -> None:
        self.name = path.name
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.direct: int | None = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            self.direct = None

    def read(self, view: memoryview, offset: int) -> None:
        done = 0
        try:
            done = os.preadv(self.fd, [view], offset, os.RWF_NOWAIT) // PAGE * PAGE
        except OSError:  # not cached (EAGAIN), or a file system without RWF_NOWAIT
            done = 0
        while done < len(view):
            fd = self.fd if self.direct is None else self.direct
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.direct is not None:
                    os.close(self.direct)  # direct I/O opened but refused (alignment): read through the cache
                    self.direct = None
                    continue
                raise StorageError(f"cannot read memory layer {self.name}: {exc}") from exc
            if n <= 0:
                raise StorageError(f"memory layer {self.name} is truncated")
            done += n

    def close(self) -> None:
        os.close(self.fd)
        if self.direct is not None:
            os.close(self.direct)


def compact(chain: Sequence[Path], out: Path, digests: Sequence[str | None] = ()) -> LayerInfo:
    """Merge a chain into one layer holding the newest version of every page. Each layer is
    checked against its recorded digest first: the merged layer gets a checksum of its own,
    which would otherwise vouch for a corrupt input. Raises CorruptLayer."""
    for path, digest in zip(chain, digests):
        if digest and not digest_matches(path, digest):
            raise CorruptLayer(path)
    layers = [LayerFile(p) for p in chain]
    index = _Chain(layers)
    failed: tuple[int | None, str] | None = None
    try:
        digest = xxhash.xxh3_128()
        with open(out, "wb") as f:
            f.seek(PAGE)
            _write_newest(f, index, digest)
            info = _seal(f, digest, layers[-1].mapping_size, _runs_of(index.pages), out)
    except OSError as exc:
        # Only its number and words are kept: its traceback holds views of the layers'
        # mappings, which then could not be closed.
        failed = exc.errno, str(exc)
        out.unlink(missing_ok=True)
    finally:
        index.release()
        del index
        for layer in layers:
            layer.close()
    if failed is not None:
        if failed[0] == errno.ENOSPC:
            raise DiskFull(f"no space left on {out.parent} to compact memory layers; free disk space")
        raise StorageError(f"cannot compact memory layers into {out}: {failed[1]}")
    return info


def _write_newest(f: BinaryIO, index: _Chain, digest: xxhash.xxh3_128) -> None:
    """The newest version of each page, in page order (its own scope: no view of a layer
    may outlive it, or the layer cannot be unmapped)."""
    step = _CHUNK // PAGE
    for lo in range(0, len(index.pages), step):
        sl = slice(lo, lo + step)
        block = np.empty((len(index.pages[sl]), PAGE // 8), dtype=np.uint64)
        for i, rows in enumerate(index.rows):
            mask = index.layer[sl] == i
            block[mask] = rows[index.row[sl][mask]]
        f.write(block)
        digest.update(block)


def prefetch(path: Path) -> None:
    """Read a layer into the page cache (in a worker thread, in the background): a sandbox
    resumed on its parked VM compares its next capture with this layer, which its pause may
    have written with direct I/O (``capture(uncached=True)``, a large layer). A plain read,
    because the kernel's own readahead (``POSIX_FADV_WILLNEED``) stops after a few MiB."""
    buf = bytearray(_CHUNK)
    try:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    except OSError:
        pass  # an optimisation only


WHOLE = "w"  # prefix of a digest over every byte of a file (device states); see digest_matches


def digest_matches(path: Path, digest: str) -> bool:
    """Whether the layer at ``path`` has the recorded ``digest``: over the whole file when it
    is a whole-file digest, else the memory-layer form of ``file_digest`` (which device states
    were also recorded with before the whole-file form existed, and are still checked with)."""
    if digest.startswith(WHOLE):
        return whole_file_digest(path) == digest
    return file_digest(path) == digest


def whole_file_digest(path: Path) -> str:
    """xxh3-128 of every byte of a file, prefixed ``WHOLE``: for layers that are not memory
    layers (a device state has data in its first page, which ``file_digest`` skips)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        _hash_rest(f, h)
    return WHOLE + h.hexdigest()


def _hash_rest(f: BinaryIO, h: xxhash.xxh3_128) -> None:
    """Feed ``h`` the file from its current position to its end, a chunk at a time."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])


def file_digest(path: Path) -> str:
    """xxh3-128 of a memory layer as ``capture`` computes it while writing: the pages and
    runs table (from PAGE on), then the header; the header's padding is not part of it."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        f.seek(PAGE)
        _hash_rest(f, h)
        f.seek(0)
        h.update(f.read(_HEADER.size))
    return h.hexdigest()


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Copy bytes [start, end) to the same offsets: in the kernel where it can (same file
    system), else through a buffer (tmpfs to disk is EXDEV for copy_file_range)."""
    off = start
    try:
        while off < end:
            n = os.copy_file_range(src, dst, end - off, off, off)
            if n <= 0:
                break
            off += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    while off < end:
        data = os.pread(src, min(end - off, 8 << 20), off)
        if not data:
            break
        os.pwrite(dst, data, off)
        off += len(data)


def materialize(base: Path, chain: Sequence[Path], out: Path) -> int:
    """Write ``out`` = the base memory file with the chain's pages applied: a memory file that
    sandboxes map copy-on-write *instead of* writing the chain into each one's RAM (fork
    children share its page cache and start without a page copy). Holes stay holes. Returns
    the bytes written."""
    written = 0
    try:
        with open(base, "rb") as src, open(out, "wb") as dst:
            size = os.fstat(src.fileno()).st_size
            dst.truncate(size)
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(src.fileno(), pos, os.SEEK_DATA)
                except OSError:  # ENXIO: no data after pos
                    break
                end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
                _copy_range(src.fileno(), dst.fileno(), start, end)
                written += end - start
                pos = end
            for path in chain:
                layer = LayerFile(path)
                try:
                    view = layer.view()
                    off = layer.data_offset
                    for first, count in layer.runs:
                        nbytes = count * PAGE
                        os.pwrite(dst.fileno(), view[off:off + nbytes], first * PAGE)
                        off += nbytes
                        written += nbytes
                    del view
                finally:
                    layer.close()
    except OSError as exc:
        out.unlink(missing_ok=True)
        if exc.errno == 28:
            raise DiskFull(f"no space left on {out.parent} for the memory file {out.name}") from exc
        raise StorageError(f"cannot write memory file {out}: {exc}") from exc
    return written
