"""An httpx transport for plain-HTTP traffic to guests, on asyncio itself.

Why: every command an SDK runs goes through the server's sandbox proxy, and on a small host
the server's CPU per request is on the round trip's critical path (it shares the cores with
the emulated guest). httpx's default transport runs httpcore on anyio, which puts a cancel
scope, a backend lookup and a task check around every socket read and write. This transport
keeps httpcore's connection pool and HTTP/1.1 state machine (a well-kept parser, keep-alive,
pooling limits) and gives it a network stream that is an asyncio ``Protocol``: bytes wait in
a buffer for ``read``, writes go to the transport, a timeout is a timer only when one is set.

Plain TCP only (guests are reached without TLS); anything else uses httpx's own transport.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Iterator
from http.cookiejar import CookieJar
from typing import Any

import httpcore
import httpx

# Received bytes kept per connection before reading from the socket pauses (bounded buffering:
# a slow consumer holds the guest back instead of growing the server's memory).
READ_BUFFER = 256 * 1024

# httpcore's errors as httpx's, most specific first (httpx maps them the same way).
_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


# httpcore's names for a connection's details → asyncio's.
_EXTRA_INFO = {"socket": "socket", "client_addr": "sockname", "server_addr": "peername"}


@contextlib.contextmanager
def _as_httpx(request: httpx.Request) -> Iterator[None]:
    try:
        yield
    except httpcore.ProxyError as exc:
        raise httpx.ProxyError(str(exc), request=request) from exc
    except Exception as exc:
        for theirs, ours in _ERRORS:
            if isinstance(exc, theirs):
                raise ours(str(exc), request=request) from exc
        raise


@contextlib.asynccontextmanager
async def _deadline(timeout: float | None) -> AsyncIterator[None]:
    if timeout is None:
        yield
    else:
        async with asyncio.timeout(timeout):
            yield


class _Connection(asyncio.Protocol):
    """One TCP connection: what ``httpcore`` reads and writes through ``_Stream``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: Exception | None = None
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > READ_BUFFER and not self._paused:
            self._paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake_reader()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def _wake_reader(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    async def read(self, max_bytes: int) -> bytes:
        while not self.buffer and not self.eof:
            self._readable = asyncio.get_running_loop().create_future()
            try:
                await self._readable
            finally:
                self._readable = None
        if not self.buffer:
            if self.error is not None:
                raise httpcore.ReadError(str(self.error))
            return b""
        data = bytes(self.buffer[:max_bytes])
        del self.buffer[:max_bytes]
        if self._paused and len(self.buffer) <= READ_BUFFER // 2:
            self._paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return data

    async def write(self, data: bytes) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self.transport.write(data)
        if self._writable is not None:
            await self._writable


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._conn.buffer:  # the common case: no timer, no wait
            return await self._conn.read(max_bytes)
        try:
            async with _deadline(timeout):
                return await self._conn.read(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(f"no data within {timeout} s") from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with _deadline(timeout):
                await self._conn.write(buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(f"could not write within {timeout} s") from exc

    async def aclose(self) -> None:
        # httpcore closes only a connection it throws away: what it had not sent is not wanted,
        # and close() would keep the socket open until a guest that stopped reading took it.
        if self._conn.transport is not None:
            self._conn.transport.abort()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS is not available on this transport (plain HTTP to guests)")

    def get_extra_info(self, info: str) -> Any:
        transport = self._conn.transport
        if info == "is_readable":  # httpcore asks before reusing an idle connection
            return bool(self._conn.buffer) or self._conn.eof
        name = _EXTRA_INFO.get(info)
        return transport.get_extra_info(name) if transport is not None and name else None


class _Backend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with _deadline(timeout):
                transport, conn = await loop.create_connection(
                    _Connection, host, port, local_addr=(local_address, 0) if local_address else None)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"no connection to {host}:{port} within {timeout} s") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = transport.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)  # type: ignore[arg-type]
        return _Stream(conn)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not available on this transport")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: Any, request: httpx.Request) -> None:
        self._stream, self._request = stream, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx(self._request):
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        if hasattr(self._stream, "aclose"):
            with _as_httpx(self._request):
                await self._stream.aclose()


TARGET = "aenv_target"  # request extension: the raw request target to send (bytes)


class NoCookies(CookieJar):
    """A cookie jar that keeps nothing. An httpx client stores every ``Set-Cookie`` of every
    response in its jar; a client that talks to a guest never sends one back, so its jar only
    grows, by as many cookies as the guest's servers set (one per path for a cookie without
    ``Path``): the server's memory, at a guest's discretion, for the sandbox's lifetime."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: Any) -> None:
        return None


class GuestTransport(httpx.AsyncBaseTransport):
    """httpx transport for ``http://`` to guests: httpcore's pool on plain asyncio sockets."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_Backend())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{request.url.scheme}: this transport speaks plain HTTP only",
                                            request=request)
        assert isinstance(request.stream, httpx.AsyncByteStream)
        req = httpcore.Request(
            method=request.method,
            # A request target given as sent (the sandbox proxy's ``TARGET``): httpx's URL
            # would normalise it (``/a/../b`` to ``/b``, ``{`` to ``%7B``).
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                             target=request.extensions.get(TARGET) or request.url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        with _as_httpx(request):
            resp = await self._pool.handle_async_request(req)
        return httpx.Response(status_code=resp.status, headers=resp.headers, stream=_Body(resp.stream, request),
                              extensions=resp.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()

