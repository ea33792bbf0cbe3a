"""envd_client/transport.py against real HTTP servers on loopback: the errors httpx users (the
sandbox proxy) tell apart, keep-alive reuse, a connection the server closed, and bounded
buffering of a response nobody reads."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest

from agentenv.envd_client.transport import GuestTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=4, keepalive_expiry=60)
    return httpx.AsyncClient(transport=GuestTransport(limits), timeout=httpx.Timeout(5.0))


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def _serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server on a free loopback port; the list counts the connections it accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", accepted


def test_a_refused_port_is_a_connect_error() -> None:
    """The proxy retries and then answers "port is not open" on exactly this error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused

    async def main() -> None:
        async with _client() as c:
            with pytest.raises(httpx.ConnectError):
                await c.get(f"http://127.0.0.1:{port}/")

    asyncio.run(main())


def test_keep_alive_is_reused_and_a_connection_closed_by_the_server_is_not() -> None:
    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    async def close_after_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then closed, without a Connection: close header

    async def main() -> None:
        for handler, connections in ((keep_alive, 1), (close_after_one, 3)):
            server, url, accepted = await _serve(handler)
            async with server, _client() as c:
                for _ in range(3):
                    r = await c.get(url + "/x")
                    assert (r.status_code, r.text) == (200, "ok")
                    await asyncio.sleep(0.05)  # (the close reaches the client before the next request)
            assert len(accepted) == connections, handler.__name__

    asyncio.run(main())


def test_a_silent_server_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async def main() -> None:
        server, url, _ = await _serve(silent)
        async with server, _client() as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.get(url, timeout=httpx.Timeout(5.0, read=0.3))

    asyncio.run(main())


def test_a_response_nobody_reads_holds_the_sender_back() -> None:
    """Reading pauses once READ_BUFFER waits in the client: the guest's writes then wait, and
    the server's memory does not grow with a stream a slow consumer is not reading."""
    # More than the socket buffers of both sides can take (tcp_rmem max + tcp_wmem max, 32 + 4 MiB
    # on this host): at least half of it must then wait in the server.
    body = b"x" * (96 << 20)
    held: list[int] = []

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await asyncio.sleep(1.0)  # the client reads nothing meanwhile
        held.append(writer.transport.get_write_buffer_size())
        await writer.drain()

    async def main() -> None:
        server, url, _ = await _serve(big)
        async with server, _client() as c:
            async with c.stream("GET", url) as r:
                await asyncio.sleep(1.5)
                assert held and held[0] > len(body) // 2, "the client took the body into its memory"
                got = 0
                async for part in r.aiter_raw():
                    got += len(part)
                assert got == len(body)

    asyncio.run(main())


def _sockets() -> int:
    """Open socket descriptors of this process."""
    fds = os.listdir("/proc/self/fd")
    return sum(1 for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")
               and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"))


def test_a_cut_upload_to_a_guest_that_stopped_reading_frees_its_socket_at_once() -> None:
    """A request cut (its client gone, its sandbox killed) while its body waits for a guest
    that reads nothing: the connection is dropped with what it still had to send, not kept
    open until TCP gives up (about 15 minutes) with its buffer."""
    stalled = asyncio.Event()

    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stalled.set()
        await asyncio.sleep(30)

    async def main() -> None:
        server, url, _ = await _serve(deaf)
        async with server, _client() as c:
            before = _sockets()

            async def body():  # more than both sides' socket buffers take
                for _ in range(256):
                    yield b"x" * (1 << 20)

            upload = asyncio.create_task(c.post(url, content=body(), timeout=httpx.Timeout(60.0)))
            await stalled.wait()
            await asyncio.sleep(1.0)
            assert not upload.done() and _sockets() == before + 2  # the client's and the server's
            upload.cancel()
            await asyncio.gather(upload, return_exceptions=True)
            await asyncio.sleep(0.2)
            assert _sockets() == before + 1, "the client's socket outlived the cut request"

    asyncio.run(main())
