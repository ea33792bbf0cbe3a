"""Users, path and file-metadata helpers, the filesystem service's blocking work, and the
``/files`` helpers (streaming multipart parser, atomic install). Runs in the thread pool."""

from __future__ import annotations

import contextlib
import datetime
import errno
import grp
import os
import pwd
import re
import shutil
import stat
import tempfile
import threading
from typing import AsyncIterator, Iterator

from .common import UPLOAD_PREFIX, ConnectError, HttpError, User


def chown_to(path_or_fd: str | int, user: User) -> None:
    """Give a file to the user; only possible (and needed) when the agent runs as root."""
    if os.geteuid() == 0:
        os.chown(path_or_fd, user.uid, user.gid, follow_symlinks=False) if isinstance(
            path_or_fd, str) else os.fchown(path_or_fd, user.uid, user.gid)


def make_dirs(path: str, user: User) -> None:
    """``mkdir -p`` where every directory created is 0755 and owned by the user."""
    missing, target = [], path
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            continue
        os.chmod(directory, 0o755)
        chown_to(directory, user)
    if not os.path.isdir(target):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", target)


def go_permissions(mode: int) -> str:
    """Render a mode like Go's ``os.FileMode.String()`` (``drwxr-xr-x``, ``Lrwxrwxrwx``, ``dtrwx...``)."""
    fmt = stat.S_IFMT(mode)
    flags = "".join(letter for letter, on in (
        ("d", fmt == stat.S_IFDIR), ("L", fmt == stat.S_IFLNK),
        ("D", fmt in (stat.S_IFBLK, stat.S_IFCHR)), ("p", fmt == stat.S_IFIFO),
        ("S", fmt == stat.S_IFSOCK), ("u", mode & stat.S_ISUID), ("g", mode & stat.S_ISGID),
        ("c", fmt == stat.S_IFCHR), ("t", mode & stat.S_ISVTX)) if on)
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (flags or "-") + rwx


def rfc3339(ns: int) -> str:
    """Format a timestamp like protobuf's JSON mapping (0, 3, 6 or 9 fractional digits, UTC)."""
    sec, frac = divmod(ns, 10**9)
    text = (datetime.datetime(1970, 1, 1) + datetime.timedelta(seconds=sec)).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        digits = f"{frac:09d}"
        text += "." + (digits[:3] if frac % 10**6 == 0 else digits[:6] if frac % 1000 == 0 else digits)
    return text + "Z"


def file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "FILE_TYPE_FILE"
    if stat.S_ISDIR(mode):
        return "FILE_TYPE_DIRECTORY"
    return "FILE_TYPE_SYMLINK" if stat.S_ISLNK(mode) else ""


def entry_info(path: str) -> dict:
    """EntryInfo as envd builds it: lstat for name/size/permissions; for a symlink the *target's*
    type and mode plus its resolved path. Default values are omitted, as proto3 JSON does."""
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path '{path}' does not exist") from None
    kind, mode, target = file_type(lst.st_mode), stat.S_IMODE(lst.st_mode) & 0o777, None
    if stat.S_ISLNK(lst.st_mode):
        try:
            target = os.path.realpath(path, strict=True)
        except OSError:  # broken or looping link: like Go's EvalSymlinks failing
            target = path
        try:
            st = os.stat(target)
            kind, mode = file_type(st.st_mode), stat.S_IMODE(st.st_mode) & 0o777
        except OSError:
            kind, mode = "", 0
    try:
        owner = pwd.getpwuid(lst.st_uid).pw_name
    except KeyError:
        owner = str(lst.st_uid)
    try:
        group = grp.getgrgid(lst.st_gid).gr_name
    except KeyError:
        group = str(lst.st_gid)
    entry = {"name": os.path.basename(path) or path, "type": kind, "path": path,
             "size": str(lst.st_size) if lst.st_size else "", "mode": mode,
             "permissions": go_permissions(lst.st_mode), "owner": owner, "group": group,
             "modifiedTime": rfc3339(lst.st_mtime_ns), "symlinkTarget": target}
    try:
        metadata = {name[len("user.e2b."):]: os.getxattr(path, name, follow_symlinks=False).decode(
            errors="replace") for name in os.listxattr(path, follow_symlinks=False)
            if name.startswith("user.e2b.")}
        entry["metadata"] = metadata
    except OSError:
        pass
    return {k: v for k, v in entry.items() if v not in (None, "", 0, {})}


MAX_LIST_ENTRIES = 200_000  # one ListDir answer: ~40 MB of JSON, ~200 MB of the agent's memory


def list_dir(root: str, depth: int, stop: threading.Event | None = None) -> list[dict]:
    """Entries below root up to ``depth`` levels, in Go's lexical pre-order walk order.

    Bounded: a walk of ``/`` at depth 100 would hold the whole file system (``/proc``
    included) in the agent's memory, and a guest OOM kill takes every process with it. So at
    most ``MAX_LIST_ENTRIES``, then ``resource_exhausted``. ``stop`` ends a walk whose caller
    has gone (a thread cannot be cancelled). Iterative, so no tree is too deep for it."""
    if not os.path.lexists(root):
        raise ConnectError("not_found", f"path '{root}' does not exist")
    if not os.path.isdir(root):
        raise ConnectError("invalid_argument", f"path '{root}' is not a directory")
    entries: list[dict] = []
    # The directories being walked, innermost last: each with the names it has left.
    stack: list[tuple[str, int, Iterator[str]]] = [(root, 1, iter(_names(root)))]
    while stack:
        if stop is not None and stop.is_set():
            return entries
        directory, level, names = stack[-1]
        name = next(names, None)
        if name is None:
            stack.pop()
            continue
        path = os.path.join(directory, name)
        try:
            entries.append(entry_info(path))
        except ConnectError:  # vanished meanwhile
            continue
        if len(entries) > MAX_LIST_ENTRIES:
            raise ConnectError("resource_exhausted", f"more than {MAX_LIST_ENTRIES} entries below '{root}' "
                               f"at depth {depth}: list a smaller depth or a subdirectory")
        if level < depth and os.path.isdir(path) and not os.path.islink(path):
            stack.append((path, level + 1, iter(_names(path))))
    return entries


def _names(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def make_dir(path: str, user: User) -> dict:
    if os.path.isdir(path):
        raise ConnectError("already_exists", f"directory '{path}' already exists")
    if os.path.lexists(path):
        raise ConnectError("invalid_argument", f"path '{path}' already exists and is not a directory")
    make_dirs(path, user)
    return entry_info(path)


def move(source: str, destination: str, user: User) -> dict:
    if not os.path.lexists(source):
        raise ConnectError("not_found", f"path '{source}' does not exist")
    make_dirs(os.path.dirname(destination), user)
    # rename(2), as envd's os.Rename: onto an existing directory it fails or replaces an empty
    # one, never moves the source inside it (shutil.move would). Across filesystems, where
    # rename cannot work, a copy and delete to a path that does not exist yet.
    try:
        os.rename(source, destination)
    except OSError as exc:
        if exc.errno != errno.EXDEV or os.path.lexists(destination):
            raise ConnectError("internal", f"error renaming: {exc.strerror}: '{source}' -> '{destination}'") from None
        shutil.move(source, destination)
    return entry_info(destination)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Multipart:
    """Streaming ``multipart/form-data`` parser: parts' bodies are yielded as they arrive."""

    def __init__(self, chunks: AsyncIterator[bytes], boundary: str) -> None:
        self._source = chunks.__aiter__()
        self._delimiter = b"\r\n--" + boundary.encode("latin-1")
        self._buf = bytearray(b"\r\n")  # so the first boundary looks like all later ones

    async def _fill(self) -> None:
        try:
            self._buf += await self._source.__anext__()
        except StopAsyncIteration:
            raise HttpError(400, "truncated multipart body") from None

    async def _until_delimiter(self) -> AsyncIterator[bytearray]:
        """The body up to the next delimiter. Each piece is the buffer itself, handed over
        (the parser starts a new buffer with what follows): under emulation every copy of an
        upload's bytes costs as much as the write, so a piece is never copied out."""
        keep = len(self._delimiter) - 1
        while (index := self._buf.find(self._delimiter)) < 0:
            if len(self._buf) > keep:
                piece, self._buf = self._buf, self._buf[-keep:]
                del piece[-keep:]
                yield piece
            await self._fill()
        piece, self._buf = self._buf, self._buf[index + len(self._delimiter):]
        del piece[index:]
        if piece:
            yield piece

    async def parts(self) -> AsyncIterator[tuple[dict[str, str], AsyncIterator[bytes]]]:
        """Yield ``(headers, body)``; an unconsumed body is skipped before the next part."""
        async for _ in self._until_delimiter():  # preamble
            pass
        while True:
            while len(self._buf) < 2:
                await self._fill()
            if self._buf.startswith(b"--"):
                return
            while (end := self._buf.find(b"\r\n\r\n")) < 0:
                if len(self._buf) > 64 * 1024:
                    raise HttpError(400, "multipart part headers too large")
                await self._fill()
            headers = {}
            for line in self._buf[:end].decode("utf-8", "replace").split("\r\n")[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            del self._buf[:end + 4]
            body = self._until_delimiter()
            yield headers, body
            async for _ in body:
                pass


def disposition_params(value: str) -> dict[str, str]:
    """A Content-Disposition's parameters; quoted values unescape every quoted pair (httpx
    sends a backslash in a file name as two)."""
    return {k.lower(): re.sub(r"\\(.)", r"\1", v[1:-1]) if v.startswith('"') else v.strip()
            for k, v in re.findall(r';\s*([\w*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)', value)}


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_pieces(fd: int, pieces: list[bytes | bytearray]) -> None:
    """Write the pieces in order with ``writev``: no copy to join them first."""
    views = [memoryview(p) for p in pieces if p]
    while views:
        n = os.writev(fd, views[:1024])  # IOV_MAX
        while n and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def open_upload_target(path: str, user: User) -> tuple[int, str | None, str]:
    """Open the destination of an upload; returns ``(fd, temp_path, real_path)``.

    A new file is created in place, as envd does (``O_CREAT``, ``fchown``, then the writes), so
    watchers see its CREATE, CHMOD, WRITE; if the upload fails the caller deletes it. An existing
    file is written to a hidden temporary file next to it (``temp_path``) that ``install_file``
    renames over it, so a failed upload leaves the old content untouched. A symlink is followed,
    as opening it for writing would (``real_path`` is the file actually written)."""
    if os.path.islink(path):
        path = os.path.realpath(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        fd, tmp = tempfile.mkstemp(".tmp", UPLOAD_PREFIX, os.path.dirname(path))
        return fd, tmp, path
    chown_to(fd, user)
    return fd, None, path


def install_file(fd: int, tmp: str, path: str, user: User) -> None:
    """Give the finished temp file the replaced file's mode and the user, then atomically rename
    it over the target (``path`` is the ``real_path`` of ``open_upload_target``)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)  # overwriting keeps the mode, like O_TRUNC
    except OSError:
        mode = 0o644
    os.fchmod(fd, mode)
    chown_to(fd, user)
    os.replace(tmp, path)


METADATA_XATTR = "user.e2b."  # EntryInfo.metadata: these xattrs, prefix stripped
METADATA_HEADER = "x-metadata-"


def upload_metadata(headers: dict[str, str]) -> dict[str, str]:
    """The ``X-Metadata-<key>: <value>`` headers of an upload (reference §4.8): keys lower-cased,
    keys and values printable ASCII, a key at most 246 bytes, all of it at most 4096 bytes."""
    metadata = {}
    for name, value in headers.items():
        if name.startswith(METADATA_HEADER):
            key = name[len(METADATA_HEADER):]
            if not key or len(key) > 246 or not all(" " <= c <= "~" for c in key + value):
                raise HttpError(400, f"invalid metadata header '{name}': keys and values must be "
                                     "printable ASCII and keys at most 246 bytes")
            metadata[key] = value
    if sum(len(k) + len(v) for k, v in metadata.items()) > 4096:
        raise HttpError(400, "metadata exceeds 4096 bytes")
    return metadata


def set_metadata(fd: int, metadata: dict[str, str]) -> None:
    """Store upload metadata as ``user.e2b.*`` xattrs of the (new inode of the) written file."""
    for key, value in metadata.items():
        os.setxattr(fd, METADATA_XATTR + key, value.encode())


def compose_files(sources: list[str], destination: str, user: User) -> None:
    """``/files/compose``: write the concatenation of ``sources`` to ``destination`` (replacing it
    atomically, like an upload), then delete the sources. Nothing changes if it fails."""
    for source in sources:
        if not os.path.lexists(source):
            raise HttpError(404, f"path '{source}' does not exist")
        if not os.path.isfile(source):
            raise HttpError(400, f"path '{source}' is not a regular file")
    if os.path.isdir(destination):
        raise HttpError(400, f"path '{destination}' is a directory")
    make_dirs(os.path.dirname(destination), user)
    fd, tmp, real = open_upload_target(destination, user)
    done = False
    try:
        for source in sources:
            with open(source, "rb") as src:
                while data := src.read(1024 * 1024):
                    write_all(fd, data)
        if tmp is not None:
            install_file(fd, tmp, real, user)
        done = True
    finally:
        os.close(fd)
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp if tmp is not None else real)
    for source in dict.fromkeys(sources):
        if os.path.realpath(source) != os.path.realpath(real):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(source)
