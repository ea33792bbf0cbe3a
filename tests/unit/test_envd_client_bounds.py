"""The envd client against an agent that misbehaves: what a guest sends is the sandbox's to
choose (a program in it can replace the agent on its port), so the server's memory must not
follow a length the guest declares. The agent here is a real HTTP server on loopback that
answers as a hostile guest would; the real agent's answers are tested in tests/guest."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from agentenv.envd_client import MAX_MESSAGE_BYTES, EnvdClient, EnvdError

CHUNK = b"\0" * (1 << 20)


async def _serve(respond) -> tuple[asyncio.Server, str, list[int]]:
    """A one-route agent; the list holds how many body bytes it managed to send."""
    sent = [0]

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            await respond(writer, sent)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", sent


async def _endless(writer: asyncio.StreamWriter, sent: list[int], head: bytes, first: bytes) -> None:
    """Chunked body ``first`` then zeros for as long as the client reads (up to 1 GiB)."""
    writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"Transfer-Encoding: chunked\r\n\r\n")
    writer.write(b"%x\r\n%s\r\n" % (len(first), first))
    while sent[0] < 1 << 30:
        writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
        sent[0] += len(CHUNK)
        await writer.drain()


def test_a_stream_message_declared_larger_than_the_bound_is_refused_before_it_is_read() -> None:
    async def hostile(writer: asyncio.StreamWriter, sent: list[int]) -> None:
        envelope = struct.pack(">BI", 0, 0xFFFFFFF0)  # a 4 GiB message, then its "bytes"
        await _endless(writer, sent, b"Content-Type: application/connect+json\r\n", envelope)

    async def main() -> None:
        server, url, sent = await _serve(hostile)
        async with server, EnvdClient(url, timeout=5) as client:
            with pytest.raises(EnvdError) as err:
                await asyncio.wait_for(client.run("true"), 20)
        assert err.value.code == "resource_exhausted" and str(MAX_MESSAGE_BYTES) in err.value.message
        assert sent[0] < 4 * MAX_MESSAGE_BYTES  # stopped reading (the socket buffers hold some)

    asyncio.run(main())


def test_a_unary_answer_larger_than_the_bound_is_refused_and_an_error_answer_cut() -> None:
    async def endless_json(writer: asyncio.StreamWriter, sent: list[int]) -> None:
        await _endless(writer, sent, b"Content-Type: application/json\r\n", b'{"processes": "')

    async def declared(writer: asyncio.StreamWriter, sent: list[int]) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n{" % (1 << 40))
        await writer.drain()
        await asyncio.sleep(30)

    async def endless_error(writer: asyncio.StreamWriter, sent: list[int]) -> None:
        message = json.dumps({"code": "internal", "message": "x" * 100}).encode()
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(message), message))
        while sent[0] < 1 << 30:
            writer.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
            sent[0] += len(CHUNK)
            await writer.drain()

    async def main() -> None:
        for respond in (endless_json, declared):
            server, url, sent = await _serve(respond)
            async with server, EnvdClient(url, timeout=5) as client:
                with pytest.raises(EnvdError) as err:
                    await asyncio.wait_for(client.list_processes(), 20)
            assert err.value.code == "resource_exhausted", err.value
            assert sent[0] < 4 * MAX_MESSAGE_BYTES
        server, url, sent = await _serve(endless_error)
        async with server, EnvdClient(url, timeout=5) as client:
            with pytest.raises(EnvdError) as err:
                await asyncio.wait_for(client.list_processes(), 20)
        # The JSON is cut, so the message is the body's start as text.
        assert err.value.code == "internal" and err.value.message.startswith('{"code": "internal"')
        assert sent[0] < 4 * MAX_MESSAGE_BYTES

    asyncio.run(main())
