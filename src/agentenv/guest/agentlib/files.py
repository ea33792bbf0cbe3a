"""``/files`` (download, upload) and ``/files/compose``: streamed with bounded memory both ways.

Downloads are read in FILE_CHUNK pieces, gzip-compressed on the fly when the client accepts gzip
and the file's start compresses, and honour a single byte range. Uploads (multipart, raw, gzip-encoded) are written as they arrive;
a failed upload leaves nothing behind (see ``fsutil.open_upload_target``).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import os
import re
import stat
import time
import urllib.parse
import zlib
from typing import Any, AsyncIterator, Iterator

from .common import (
    FILE_CHUNK,
    HttpError,
    User,
    blocking,
    field,
    lookup_user,
    parse_json_object,
)
from .fsutil import (
    Multipart,
    compose_files,
    disposition_params,
    entry_info,
    install_file,
    make_dirs,
    open_upload_target,
    set_metadata,
    upload_metadata,
    write_pieces,
)
from .httpio import Request, Response

GZIP_LEVEL = 1  # deflate's fastest level: most of the saving at a fraction of level 6's CPU
# /proc files report a size of 0 and /sys files 4096, whatever they hold: such a file (no block
# on a disk, a page or less by its size) is read to its end, up to this, and sent as read.
PSEUDO_MAX = 16 << 20
SAMPLE = 64 * 1024  # what decides whether a download is compressed



def read_to_end(fd: int, limit: int) -> bytes | None:
    """All of a file read from its start until EOF, or None past ``limit`` bytes (blocking)."""
    chunks, size = [], 0
    while True:
        chunk = os.pread(fd, 65536, size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None

class FilesService:
    """The ``/files`` routes; ``agent`` is the Agent of agent.py (paths, token, default user)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def auth(self, req: Request, operation: str) -> User:
        """A valid X-Access-Token header, or else a valid ``v1_`` URL signature (§4.7)."""
        token = self.agent.access_token
        if token is not None:
            header = req.headers.get("x-access-token")
            if header is not None:
                if not hmac.compare_digest(header.encode(), token.encode()):
                    raise HttpError(401, "unauthorized access, please provide a valid access token")
            else:
                q = req.query
                raw = f"{q.get('path', '')}:{operation}:{q.get('username', '')}:{token}"
                if q.get("signature_expiration"):
                    raw += f":{q['signature_expiration']}"
                expected = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")
                if not hmac.compare_digest(q.get("signature", "").encode(), expected.encode()):
                    raise HttpError(401, "missing or invalid signature")
                expiration = q.get("signature_expiration")
                if expiration and (not expiration.isdigit() or int(expiration) < time.time()):
                    raise HttpError(401, "signature is already expired")
        name = req.query.get("username") or self.agent.default_user
        user = lookup_user(name)
        if user is None:
            raise HttpError(401, f"invalid username: '{name}'")
        return user

    async def download(self, req: Request, resp: Response, user: User) -> None:
        """Stream a file in FILE_CHUNK pieces (bounded memory); gzip-compressed on the fly when the
        client accepts gzip (SDK ``files.read(gzip=True)``), else with its exact length."""
        path = self.agent.resolve(req.query.get("path", ""), user)
        encoding = negotiate_encoding(req.headers.get("accept-encoding"))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # NONBLOCK: FIFOs
        except FileNotFoundError:
            raise HttpError(404, f"path '{path}' does not exist") from None
        except OSError as exc:
            raise HttpError(400, f"cannot open '{path}': {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise HttpError(400, f"path '{path}' is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise HttpError(400, f"path '{path}' is not a regular file")
            if encoding is None:
                raise HttpError(406, "no acceptable content encoding (gzip and identity are supported)")
            if st.st_blocks == 0 and st.st_size <= 4096:  # /proc, /sys (or an empty or all-hole page)
                data = await blocking(read_to_end, fd, PSEUDO_MAX)
                if data is None:
                    raise HttpError(400, f"'{path}' reads as more than {PSEUDO_MAX >> 20} MiB")
                return await resp.send(200, data, {"Content-Type": "application/octet-stream",
                                                   "Content-Disposition": content_disposition(os.path.basename(path))})
            span = None if "if-range" in req.headers else byte_range(req.headers.get("range"), st.st_size)
            if span is not None:
                encoding = "identity"  # a range is of the file's bytes: serve them as they are
            headers = {"Content-Type": "application/octet-stream",
                       "Content-Disposition": content_disposition(os.path.basename(path)),
                       "Vary": "Accept-Encoding"}
            # Compress only what compresses: a sample of the file's start decides. Archives,
            # images, binaries and random bytes go as they are, at full speed (deflating them
            # only burns the sandbox's CPU: ~5 MB/s under TCG, vs ~40 MB/s unencoded).
            deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)
            data = None
            if encoding == "gzip":
                identity_ok = negotiate_encoding(req.headers.get("accept-encoding"), gzip=False) is not None
                data = await blocking(compress_start, fd, deflate, identity_ok)
            if data is not None:
                await resp.start(200, {**headers, "Content-Encoding": "gzip"})
                offset = FILE_CHUNK
                while True:
                    await resp.write(data)
                    if offset >= st.st_size:
                        break
                    data = await blocking(read_compressed, fd, offset, st.st_size - offset, deflate)
                    if data is None:
                        break  # the file shrank meanwhile: send what there is
                    offset += FILE_CHUNK
                return await resp.finish(deflate.flush())
            headers["Accept-Ranges"] = "bytes"
            start, end = 0, st.st_size
            if span is not None:
                start, end = span
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
            await resp.start(206 if span else 200, headers, end - start)
            # sendfile runs on the event loop: have the kernel read the file ahead in a worker
            # thread first, so that it sends from the page cache instead of waiting on the disk.
            await blocking(os.posix_fadvise, fd, start, end - start, os.POSIX_FADV_WILLNEED)
            if await resp.send_file(fd, start, end - start) < end - start:
                resp.keep_alive = False  # the file shrank: Content-Length cannot be honoured
        finally:
            os.close(fd)

    async def upload(self, req: Request, resp: Response, user: User) -> None:
        ctype = req.headers.get("content-type", "")
        gzipped = req.headers.get("content-encoding", "").lower() == "gzip"
        query_path = req.query.get("path")
        written = []
        try:
            metadata = upload_metadata(req.headers)
            if ctype.lower().startswith("multipart/form-data"):
                boundary = disposition_params(ctype).get("boundary")
                if not boundary:
                    raise HttpError(400, "multipart body without boundary")
                async for headers, body in Multipart(req.chunks(), boundary).parts():
                    params = disposition_params(headers.get("content-disposition", ""))
                    if params.get("name") == "file":
                        dest = query_path or params.get("filename")
                        if not dest:
                            raise HttpError(400, "no path query parameter and no part filename")
                        written.append(await self.store(dest, body, user, gzipped, metadata))
                await req.drain()  # the epilogue after the closing boundary
            else:
                if not query_path:
                    raise HttpError(400, "the path query parameter is required")
                written.append(await self.store(query_path, req.chunks(), user, gzipped, metadata))
        except HttpError:
            await req.drain()  # read the rest so the client gets our answer, not a reset
            raise
        await resp.send_json(200, written)

    async def compose(self, req: Request, resp: Response) -> None:
        """``POST /files/compose {source_paths, destination, username?}`` -> EntryInfo of the result."""
        body = parse_json_object(await req.read_body())
        name = field(body, "username") or self.agent.default_user
        user = lookup_user(str(name))
        if user is None:
            raise HttpError(401, f"invalid username: '{name}'")
        sources, destination = field(body, "sourcePaths"), body.get("destination")
        if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
            raise HttpError(400, "source_paths must be a non-empty list of paths")
        if not isinstance(destination, str) or not destination:
            raise HttpError(400, "destination is required")
        dest = self.agent.resolve(destination, user)
        try:
            await blocking(compose_files, [self.agent.resolve(s, user) for s in sources], dest, user)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HttpError(507, f"not enough disk space to write '{dest}'") from None
            raise HttpError(500, f"cannot compose '{dest}': {exc.strerror}") from None
        await resp.send_json(200, await blocking(entry_info, dest))

    async def store(self, dest: str, chunks: AsyncIterator[bytes], user: User, gzipped: bool,
                    metadata: dict[str, str]) -> dict:
        """Stream one upload to disk with bounded memory. A failed or interrupted upload leaves
        nothing behind: a new file is deleted, an existing one keeps its old content (see
        ``open_upload_target``). ``metadata`` replaces the file's metadata xattrs."""
        path = self.agent.resolve(dest, user)
        if os.path.isdir(path):
            raise HttpError(400, f"path '{path}' is a directory")
        fd, tmp, done, real_path = -1, None, False, path
        try:
            await blocking(make_dirs, os.path.dirname(path), user)
            fd, tmp, real_path = await blocking(open_upload_target, path, user)
            inflate = GzipMembers() if gzipped else None
            # Pieces are gathered up to FILE_CHUNK and written with one writev in a worker
            # thread: not joined into one buffer first (a copy of every byte, as costly as the
            # write under emulation), and not one thread hand-off per network read.
            pending: list[bytes | bytearray] = []
            size = 0
            async for data in chunks:
                for piece in (inflate.feed(data) if inflate else (data,)):
                    pending.append(piece)
                    size += len(piece)
                    if size >= FILE_CHUNK:
                        await blocking(write_pieces, fd, pending)
                        pending, size = [], 0
            if inflate:
                pending.append(inflate.finish())
            await blocking(write_pieces, fd, pending)
            if metadata:
                await blocking(set_metadata, fd, metadata)
            if tmp is not None:
                await blocking(install_file, fd, tmp, real_path, user)
                tmp = None  # it is the final file now
            done = True
        except zlib.error:
            raise HttpError(400, "invalid gzip body") from None
        except ConnectionError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HttpError(507, f"not enough disk space to write '{path}'") from None
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP) and metadata:
                raise HttpError(400, f"the filesystem of '{path}' cannot store metadata (xattrs)") from None
            raise HttpError(400 if exc.errno in (errno.ENOTDIR, errno.EISDIR) else 500,
                            f"cannot write '{path}': {exc.strerror}") from None
        finally:
            if fd >= 0:
                if not done:  # only the file this upload made: another upload may have replaced it
                    victim = tmp if tmp is not None else real_path
                    with contextlib.suppress(OSError):
                        mine, there = os.fstat(fd), os.lstat(victim)
                        if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                            os.unlink(victim)
                os.close(fd)
        item = {"path": path, "name": os.path.basename(path), "type": "file"}
        if metadata:
            item["metadata"] = metadata
        return item


def negotiate_encoding(accept: str | None, gzip: bool = True) -> str | None:
    """``gzip`` if the client accepts it (and ``gzip`` is offered), else ``identity`` unless
    refused (then None: 406)."""
    if not accept:
        return "identity"
    q: dict[str, float] = {}
    for item in accept.split(","):
        coding, _, params = item.strip().partition(";")
        weight = 1.0
        if (m := re.search(r"q\s*=\s*([0-9.]+)", params)) is not None:
            try:
                weight = float(m.group(1))
            except ValueError:
                weight = 0.0
        q[coding.strip().lower()] = weight
    if gzip and q.get("gzip", q.get("x-gzip", q.get("*", 0.0))) > 0:
        return "gzip"
    return "identity" if q.get("identity", q.get("*", 1.0)) > 0 else None


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single ``Range: bytes=a-b`` / ``a-`` / ``-n`` request; None serves the
    whole file (no header, several ranges, other units); unsatisfiable is 416."""
    if not header or not (m := re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)):
        return None
    first, last = m.group(1), m.group(2)
    if not first and not last:
        return None
    if not first:  # suffix: the last n bytes
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise HttpError(416, f"range '{header}' not satisfiable for a file of {size} bytes")
    return start, end


def compress_start(fd: int, deflate: Any, sample: bool) -> bytes | None:
    """The file's first FILE_CHUNK compressed; with ``sample`` (the client also takes identity),
    None when deflate does not shrink its first SAMPLE bytes below 90 % (or the file is empty):
    then it is better sent as it is."""
    data = os.pread(fd, FILE_CHUNK, 0)
    head = data[:SAMPLE]
    if sample and (not head or len(zlib.compress(head, GZIP_LEVEL)) >= 0.9 * len(head)):
        return None
    return deflate.compress(data)


def read_compressed(fd: int, offset: int, left: int, deflate: Any) -> bytes | None:
    """Read the next FILE_CHUNK of a file and compress it (thread pool: both are slow)."""
    data = os.pread(fd, min(FILE_CHUNK, left), offset)
    return deflate.compress(data) if data else None


def content_disposition(name: str) -> str:
    """``inline; filename="a.txt"``, with an RFC 6266 ``filename*`` for names that are not plain
    ASCII (HTTP headers cannot carry them raw)."""
    if name.isascii() and name.isprintable() and '"' not in name and "\\" not in name:
        return f'inline; filename="{name}"'
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name)
    quoted = urllib.parse.quote(os.fsencode(name), safe="")
    return f"inline; filename=\"{fallback}\"; filename*=UTF-8''{quoted}"


class GzipMembers:
    """A gzip body, inflated member after member: ``cat a.gz b.gz`` and pigz make several, and
    envd (Go's gzip reader) reads them all; zlib alone stops after the first and would drop
    the rest. Output comes in steps of at most FILE_CHUNK, so a small "gzip bomb" cannot blow
    up memory. Anything after a member that is not another member is a zlib.error."""

    def __init__(self) -> None:
        self._member = zlib.decompressobj(wbits=31)

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data:
            if self._member.eof:  # the next member starts here
                self._member = zlib.decompressobj(wbits=31)
            out = self._member.decompress(data, FILE_CHUNK)
            if out:
                yield out
            data = self._member.unconsumed_tail or (self._member.unused_data if self._member.eof else b"")

    def finish(self) -> bytes:
        out = self._member.flush()
        if not self._member.eof:
            raise zlib.error("truncated gzip stream")
        return out
