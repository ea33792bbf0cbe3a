"""The guests' DNS forwarder (network/dns.py) against hostile clients, on loopback: a real
forwarder, a real upstream resolver stand-in (a UDP and TCP server that answers by name), and
clients from different source addresses (127.0.0.2, .3: one per sandbox, as each namespace
masquerades to its own). One sandbox must not take the forwarder from the others, and only
standard queries reach the upstream."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from agentenv.bench.node import free_port
from agentenv.network import dns

BIG = 60_000


def query(name: str, qid: int, qtype: int = 1, opcode: int = 0) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack(">HBBHHHH", qid, (opcode << 3) | 1, 0, 1, 0, 0, 0) + qname + struct.pack(">HH", qtype, 1)


def _name(q: bytes) -> str:
    labels, i = [], 12
    while q[i]:
        labels.append(q[i + 1:i + 1 + q[i]].decode())
        i += 1 + q[i]
    return ".".join(labels)


class Upstream:
    """Answers ``fast.*`` at once, ``big.*`` with BIG bytes (TCP), never ``slow.*``; keeps what it saw."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def answer(self, q: bytes) -> bytes | None:
        name = _name(q)
        self.seen.append(name)
        if name.startswith("slow"):
            return None
        body = b"\0" * (BIG if name.startswith("big") else 20)
        return q[:2] + b"\x81\x80" + q[4:12] + body

    async def start(self, port: int) -> None:
        up = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.t = transport

            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                if (a := up.answer(data)) is not None:
                    self.t.sendto(a[:512], addr)  # type: ignore[attr-defined]

        async def tcp(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                q = await r.readexactly(struct.unpack(">H", await r.readexactly(2))[0])
                if (a := up.answer(q)) is not None:
                    w.write(struct.pack(">H", len(a)) + a)
                    await w.drain()
            finally:
                w.close()

        loop = asyncio.get_running_loop()
        self.udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=("127.0.0.1", port))
        self.tcp = await asyncio.start_server(tcp, "127.0.0.1", port)

    def close(self) -> None:
        self.udp.close()
        self.tcp.close()


async def _setup() -> tuple[dns.DnsForwarder, Upstream, int]:
    upstream_port, port = free_port(), free_port()
    up = Upstream()
    await up.start(upstream_port)
    fwd = dns.DnsForwarder("127.0.0.1", [("127.0.0.1", upstream_port)], port=port)
    await fwd.start()
    return fwd, up, port


def _udp_client(source: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((source, 0))
    s.setblocking(False)
    return s


async def _udp_ask(source: str, port: int, q: bytes, timeout: float) -> bytes | None:
    loop = asyncio.get_running_loop()
    with _udp_client(source) as s:
        await loop.sock_sendto(s, q, ("127.0.0.1", port))
        try:
            return await asyncio.wait_for(loop.sock_recv(s, 4096), timeout)
        except TimeoutError:
            return None


def test_a_guest_flooding_udp_queries_does_not_starve_the_others() -> None:
    async def main() -> None:
        fwd, up, port = await _setup()
        try:
            with _udp_client("127.0.0.2") as flood:
                for i in range(dns.MAX_INFLIGHT + 100):  # queries the upstream never answers
                    flood.sendto(query(f"slow{i}.test", i & 0xFFFF), ("127.0.0.1", port))
                    if i % 32 == 31:
                        await asyncio.sleep(0.005)  # (within the forwarder's socket buffer)
                await asyncio.sleep(0.3)
                answer = await _udp_ask("127.0.0.3", port, query("fast.test", 7), timeout=2)
            assert answer is not None and answer[:2] == b"\0\x07", "another sandbox got no answer"
        finally:
            await fwd.close()
            up.close()

    asyncio.run(main())


def test_tcp_clients_that_do_not_read_their_answers_are_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dns, "MAX_TCP_CLIENTS", 2)
    monkeypatch.setattr(dns, "TCP_IDLE_S", 1.0)

    async def main() -> None:
        fwd, up, port = await _setup()
        hogs = []
        try:
            for _ in range(2):  # pipeline big answers, read none (into a small receive window)
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.bind(("127.0.0.2", 0))
                sock.connect(("127.0.0.1", port))
                r, w = await asyncio.open_connection(sock=sock)
                for i in range(300):
                    q = query(f"big{i}.test", i)
                    w.write(struct.pack(">H", len(q)) + q)
                hogs.append(w)
            await asyncio.sleep(0.5)
            deadline = asyncio.get_running_loop().time() + 10
            while True:  # another sandbox is served once the hogs are closed
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
                q = query("fast.test", 9)
                w.write(struct.pack(">H", len(q)) + q)
                try:
                    size = struct.unpack(">H", await asyncio.wait_for(r.readexactly(2), 2))[0]
                    assert (await r.readexactly(size))[:2] == b"\0\x09"
                    w.close()
                    break
                except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                    w.close()
                    assert asyncio.get_running_loop().time() < deadline, "the TCP slots stayed taken"
                    await asyncio.sleep(0.2)
        finally:
            for w in hogs:
                w.transport.abort()
            await fwd.close()
            up.close()

    asyncio.run(main())


def test_only_standard_queries_reach_the_upstream() -> None:
    """A dynamic update or a zone transfer would be made with the host's identity."""
    async def main() -> None:
        fwd, up, port = await _setup()
        try:
            update = await _udp_ask("127.0.0.2", port, query("fast.zone", 3, qtype=6, opcode=5), timeout=2)
            assert update is not None and update[:2] == b"\0\x03" and update[3] & 0x0F == dns.REFUSED
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            q = query("fast.zone", 4, qtype=252)  # AXFR
            w.write(struct.pack(">H", len(q)) + q)
            size = struct.unpack(">H", await asyncio.wait_for(r.readexactly(2), 2))[0]
            axfr = await r.readexactly(size)
            w.close()
            assert axfr[:2] == b"\0\x04" and axfr[3] & 0x0F == dns.REFUSED
            ok = await _udp_ask("127.0.0.2", port, query("fast.zone", 5), timeout=2)
            assert ok is not None and ok[3] & 0x0F == 0
            assert up.seen == ["fast.zone"]
        finally:
            await fwd.close()
            up.close()

    asyncio.run(main())
