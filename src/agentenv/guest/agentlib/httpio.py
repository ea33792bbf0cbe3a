"""A minimal HTTP/1.1 server side: request heads, streamed bodies, streamed responses."""

from __future__ import annotations

import asyncio
import re
import struct
import urllib.parse
from http import HTTPStatus
from typing import Any, AsyncIterator

from .common import (
    FILE_CHUNK,
    HEAD_TIMEOUT,
    IDLE_TIMEOUT,
    MAX_MESSAGE,
    ConnectError,
    HttpError,
    json_bytes,
    parse_json_object,
)

_DIGITS = re.compile(r"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9a-fA-F]{1,15}")

class Request:
    """One HTTP/1.1 request. The body is not read up front: handlers stream it with ``chunks()``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
                 target: str, version: str, headers: dict[str, str]) -> None:
        self.reader, self.writer, self.method, self.headers = reader, writer, method, headers
        if "?" in target or "%" in target or "#" in target or "//" in target:
            url = urllib.parse.urlsplit(target)
            self.path = urllib.parse.unquote(url.path)
            # Percent-escapes that are not UTF-8 (a Linux file name may be any bytes) map to the
            # very bytes they encode, through surrogateescape, as os.fsdecode would.
            self.query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True,
                                                     errors="surrogateescape"))
        else:  # a plain path (every RPC): nothing to split or decode
            self.path, self.query = target, {}
        conn = headers.get("connection", "").lower()
        self.keep_alive = (version == "HTTP/1.1" and "close" not in conn) or "keep-alive" in conn
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = (headers.get("content-length") or "0").strip()
        if not self._chunked and not _DIGITS.fullmatch(length):  # int() would take "-1": read to EOF
            raise HttpError(400, "invalid Content-Length")
        self._remaining = 0 if self._chunked else int(length)
        self.body_done = not self._chunked and self._remaining == 0
        self._expect_continue = headers.get("expect", "").lower() == "100-continue"
        self._body: AsyncIterator[bytes] | None = None

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, never buffered. Every caller shares one iterator, so a handler
        that stops half-way can still ``drain()`` the rest and keep the connection in sync."""
        if self._body is None:
            self._body = self._read_body_chunks()
        return self._body

    async def _read_body_chunks(self) -> AsyncIterator[bytes]:
        """Read the body from the socket, decoding chunked transfer encoding."""
        if self.body_done:
            return
        if self._expect_continue:
            self._expect_continue = False
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self._chunked:
            while self._remaining:
                data = await self.reader.read(min(self._remaining, FILE_CHUNK))
                if not data:
                    raise ConnectionResetError("client closed the connection mid-body")
                self._remaining -= len(data)
                yield data
        else:
            while True:
                line = await self.reader.readline()
                raw = line.split(b";", 1)[0].strip()
                if not _HEX.fullmatch(raw):  # int(, 16) would take "-1" too
                    raise HttpError(400, "malformed chunked body")
                size = int(raw, 16)
                if size == 0:
                    while (await self.reader.readline()).strip():  # skip trailers
                        pass
                    break
                while size:
                    data = await self.reader.read(min(size, FILE_CHUNK))
                    if not data:
                        raise ConnectionResetError("client closed the connection mid-body")
                    size -= len(data)
                    yield data
                await self.reader.readexactly(2)  # CRLF after each chunk
        self.body_done = True

    async def read_body(self, limit: int = MAX_MESSAGE) -> bytes:
        """Read the whole (small) body; larger ones are a client error."""
        body = bytearray()
        async for data in self.chunks():
            body += data
            if len(body) > limit:
                raise HttpError(413, "request body too large")
        return bytes(body)

    async def drain(self) -> None:
        """Discard any unread body so the connection can serve the next request."""
        async for _ in self.chunks():
            pass


class Response:
    """Writes one response, either whole (Content-Length) or streamed (chunked, flushed per write).

    The head is held back and sent together with the first body bytes, and the last chunk goes
    out with the terminator: each send() is a trip through the guest's TCP stack, which costs
    milliseconds when the guest is emulated, so a short stream takes two sends instead of five."""

    def __init__(self, writer: asyncio.StreamWriter, keep_alive: bool) -> None:
        self.writer, self.keep_alive = writer, keep_alive
        self.started = False
        self._chunked = False
        self._head = b""

    async def start(self, status: int, headers: dict[str, str], length: int | None = None) -> None:
        self.started = True
        all_headers = {"Access-Control-Allow-Origin": "*", **headers}
        if length is None:
            self._chunked = True
            all_headers["Transfer-Encoding"] = "chunked"
        elif status != 204:
            all_headers["Content-Length"] = str(length)
        if not self.keep_alive:
            all_headers["Connection"] = "close"
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:  # e.g. 499, Connect's "canceled"
            reason = "Unknown"
        head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in all_headers.items()) + "\r\n"
        self._head = head.encode("latin-1")

    def _take_head(self) -> bytes:
        head, self._head = self._head, b""
        return head

    async def write(self, data: bytes) -> None:
        """Send body bytes and wait until the socket accepted them (flush + back-pressure)."""
        if data and self._chunked:
            self.writer.writelines([self._take_head(), b"%x\r\n" % len(data), data, b"\r\n"])
        elif data or self._head:
            self.writer.writelines([self._take_head(), data])
        await self.writer.drain()

    async def send_file(self, fd: int, offset: int, count: int) -> int:
        """Send ``count`` body bytes of the file from ``offset`` with sendfile(2): from the page
        cache to the socket, never through Python (every copy of a download costs about as much
        as its send under emulation). Returns the bytes sent: fewer if the file shrank."""
        head = self._take_head()
        if head:
            self.writer.write(head)
        if count <= 0:  # loop.sendfile refuses a count of 0
            await self.writer.drain()
            return 0
        with open(fd, "rb", closefd=False) as f:
            return await asyncio.get_running_loop().sendfile(self.writer.transport, f, offset, count)

    async def finish(self, last: bytes = b"") -> None:
        """End the response; ``last`` (chunked only) is sent in the same write as the end."""
        parts = [self._take_head()]
        if self._chunked:
            if last:
                parts += [b"%x\r\n" % len(last), last, b"\r\n"]
            parts.append(b"0\r\n\r\n")
        self.writer.writelines(parts)
        await self.writer.drain()

    async def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        await self.start(status, headers or {}, len(body))
        await self.write(body)

    async def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json_bytes(obj), {"Content-Type": "application/json", **(headers or {})})


MAX_HEADER_LINES = 200


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
    """Parse the next request head; None on a clean close or after the idle timeout. The head
    is read in one piece: one wakeup and one split, not a ``readline`` per header (under
    emulation each costs a fraction of a millisecond, on every command). Lines end in CRLF, as
    every HTTP client sends them; RFC 9112 leaves accepting a bare LF to the server."""
    while True:
        first = b""
        try:
            async with asyncio.timeout(IDLE_TIMEOUT) as timer:
                first = await reader.readexactly(1)
                # A head, once begun, comes whole soon: a client that trickles one (or stops
                # halfway) does not hold the connection for the idle timeout.
                timer.reschedule(asyncio.get_running_loop().time() + HEAD_TIMEOUT)
                head = first + await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            if first.strip():
                raise HttpError(408, f"request head not complete after {HEAD_TIMEOUT:.0f} s") from None
            return None
        except asyncio.IncompleteReadError as exc:
            if (first + exc.partial).strip():
                raise HttpError(400, "truncated request head") from None
            return None  # closed between requests
        except asyncio.LimitOverrunError:
            raise HttpError(400, "request head too large") from None
        text = head.decode("latin-1").lstrip("\r\n")  # empty lines before a request are allowed
        if text:
            break
    lines = text.split("\r\n")
    if len(lines) > MAX_HEADER_LINES:  # repeated names are joined below: bound that work too
        raise HttpError(431, "too many header lines")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed request line")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        if not raw:
            continue
        name, sep, value = raw.partition(":")
        if not sep:
            raise HttpError(400, "malformed header")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return Request(reader, writer, parts[0].upper(), parts[1], parts[2], headers)


async def read_envelopes(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """Decode a client stream: Connect envelopes (``flags u8 | length u32 BE | JSON``) as they
    arrive, however the body was split into chunks. Malformed input is ``invalid_argument``."""
    buf = bytearray()
    async for data in chunks:
        buf += data
        while len(buf) >= 5:
            flags, length = struct.unpack_from(">BI", buf)
            if flags & 0x01:
                raise ConnectError("invalid_argument", "compressed Connect envelopes are not supported")
            if length > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"message of {length} bytes is too large")
            if len(buf) < 5 + length:
                break
            payload = bytes(buf[5:5 + length])
            del buf[:5 + length]
            if flags & 0x02:  # an end-of-stream envelope: nothing follows
                return
            yield parse_json_object(payload)
    if buf:
        raise ConnectError("invalid_argument", "truncated Connect envelope")
