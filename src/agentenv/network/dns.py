"""The host's DNS forwarder for guests: the one host service a sandbox may reach.

Guests cannot reach the host's own resolver: it is on a private, loopback or link-local
address, and those are always denied. So every guest's ``/etc/resolv.conf`` names its gateway
(169.254.0.22), each namespace DNATs port 53 there to the forwarder's address (the first
address of the slot CIDR, on the host's loopback under this node's label), and the forwarder relays each
query, as it is, to the host's resolvers (``/etc/resolv.conf``, or ``AENV_DNS_UPSTREAM``) and
the answer back. It reads only the two-byte length of TCP messages and a query's header and
question type: names are the resolver's business, so it needs no DNS library.

Only standard queries go through, and no zone transfer: the upstream sees the host as the
asker, and may grant the host what it would not grant a sandbox (an internal zone's transfer,
a dynamic update authorised by source address). Anything else is answered REFUSED here.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import struct
from pathlib import Path

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 4.0  # per upstream; the guest's resolver retries after 5 s
MAX_INFLIGHT = 512  # UDP queries being relayed at once; more are dropped (the client retries)
MAX_TCP_CLIENTS = 128  # TCP connections served at once; more are closed (a guest cannot use up our descriptors)
# Of those, one sandbox (a source address: each namespace masquerades to its own) has at most
# this many: a guest that floods the forwarder slows itself, not every other sandbox.
MAX_INFLIGHT_PER_CLIENT = 64
MAX_TCP_PER_CLIENT = 16
TCP_IDLE_S = 10.0  # a TCP client that neither sends a query nor takes its answer for this long is closed

OPCODE_QUERY = 0
REFUSED = 5
ZONE_TRANSFERS = (251, 252)  # IXFR, AXFR


def host_resolvers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[tuple[str, int]]:
    """The ``nameserver`` lines of the host's resolver configuration."""
    out = []
    try:
        lines = resolv_conf.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            try:
                out.append((str(ipaddress.ip_address(fields[1])), 53))  # a scope (%eth0) is kept
            except ValueError:
                continue
    return out


def parse_upstreams(value: str) -> list[tuple[str, int]]:
    """``AENV_DNS_UPSTREAM``: comma-separated ``address`` or ``address:port`` (IPv4)."""
    out = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        host, _, port = item.partition(":")
        try:
            out.append((str(ipaddress.ip_address(host)), int(port or 53)))
        except ValueError:
            raise ValueError(f"AENV_DNS_UPSTREAM: '{item}' is not an address or address:port") from None
    return out


def refusal(query: bytes) -> bytes | None:
    """REFUSED for a message this forwarder does not relay (not a standard query, or a zone
    transfer), else None. ``query`` has at least a DNS header (12 bytes)."""
    opcode = (query[2] >> 3) & 0x0F
    if opcode == OPCODE_QUERY and not query[2] & 0x80 and _question_type(query) not in ZONE_TRANSFERS:
        return None
    flags = bytes([0x80 | (query[2] & 0x79), (query[3] & 0x10) | REFUSED])  # QR, opcode, RD; CD, RCODE
    return query[:2] + flags + bytes(8)


def _question_type(query: bytes) -> int | None:
    """QTYPE of the first question (after its name's labels), or None when there is none."""
    if query[4:6] == b"\0\0":
        return None
    i = 12
    while i < len(query) and query[i] != 0:
        if query[i] & 0xC0:  # a pointer: not in a question a resolver sends
            return None
        i += 1 + query[i]
    return int.from_bytes(query[i + 1:i + 3], "big") if i + 3 <= len(query) else None


def _release(counts: collections.Counter[str], source: str) -> None:
    """One of ``source``'s slots given back (a source with none left is not kept)."""
    counts[source] -= 1
    if counts[source] <= 0:
        del counts[source]


class DnsForwarder:
    """Relays DNS over UDP and TCP from ``listen``:53 to ``upstreams`` (tried in order)."""

    def __init__(self, listen: str, upstreams: list[tuple[str, int]], port: int = 53) -> None:
        self.listen, self.port, self.upstreams = listen, port, upstreams
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._per_client: collections.Counter[str] = collections.Counter()  # UDP queries in flight by source
        self._tcp_clients = 0
        self._tcp_per_client: collections.Counter[str] = collections.Counter()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(
            lambda: _UdpServer(self), local_addr=(self.listen, self.port))
        self._tcp = await asyncio.start_server(self._serve_tcp, self.listen, self.port)
        log.info("DNS forwarder on %s:%d -> %s", self.listen, self.port,
                 ", ".join(f"{h}:{p}" for h, p in self.upstreams))

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for task in list(self._inflight):
            task.cancel()

    # -- UDP ---------------------------------------------------------------------------------

    def _received(self, query: bytes, client: tuple[str, int]) -> None:
        source = client[0]
        if (len(query) < 12 or len(self._inflight) >= MAX_INFLIGHT
                or self._per_client[source] >= MAX_INFLIGHT_PER_CLIENT):
            return  # not a DNS message, or overloaded: dropped, as a busy resolver does
        if (refused := refusal(query)) is not None:
            if self._udp is not None and not self._udp.is_closing():
                self._udp.sendto(refused, client)
            return
        task = asyncio.ensure_future(self._relay_udp(query, client))
        self._inflight.add(task)
        self._per_client[source] += 1

        def done(t: asyncio.Task[None]) -> None:
            self._inflight.discard(t)
            _release(self._per_client, source)

        task.add_done_callback(done)

    async def _relay_udp(self, query: bytes, client: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        for upstream in self.upstreams:
            answer: asyncio.Future[bytes] = loop.create_future()
            try:
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpClient(query[:2], answer), remote_addr=upstream)
            except OSError as exc:
                log.debug("DNS upstream %s unreachable: %s", upstream, exc)
                continue
            try:
                transport.sendto(query)
                reply = await asyncio.wait_for(answer, QUERY_TIMEOUT_S)
            except (TimeoutError, OSError):
                continue
            finally:
                transport.close()
            if self._udp is not None and not self._udp.is_closing():
                self._udp.sendto(reply, client)
            return

    # -- TCP ---------------------------------------------------------------------------------

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        if self._tcp_clients >= MAX_TCP_CLIENTS or self._tcp_per_client[source] >= MAX_TCP_PER_CLIENT:
            writer.close()
            return
        self._tcp_clients += 1
        self._tcp_per_client[source] += 1
        try:
            while True:
                async with asyncio.timeout(TCP_IDLE_S):
                    size = struct.unpack(">H", await reader.readexactly(2))[0]
                    query = await reader.readexactly(size)
                if len(query) < 12:
                    return
                reply = refusal(query) or await self._relay_tcp(query)
                if reply is None:
                    return
                # A client that does not read its answers must not hold its connection for good.
                async with asyncio.timeout(TCP_IDLE_S):
                    writer.write(struct.pack(">H", len(reply)) + reply)
                    await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._tcp_clients -= 1
            _release(self._tcp_per_client, source)
            writer.transport.abort()  # unsent answers of a client that stopped reading are dropped

    async def _relay_tcp(self, query: bytes) -> bytes | None:
        for host, port in self.upstreams:
            try:
                async with asyncio.timeout(QUERY_TIMEOUT_S):
                    r, w = await asyncio.open_connection(host, port)
                    try:
                        w.write(struct.pack(">H", len(query)) + query)
                        await w.drain()
                        size = struct.unpack(">H", await r.readexactly(2))[0]
                        return await r.readexactly(size)
                    finally:
                        w.close()
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                continue
        return None


class _UdpServer(asyncio.DatagramProtocol):
    def __init__(self, forwarder: DnsForwarder) -> None:
        self.forwarder = forwarder

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.forwarder._received(data, addr)


class _UdpClient(asyncio.DatagramProtocol):
    """One query to one upstream: the first datagram with the query's id is its answer."""

    def __init__(self, query_id: bytes, answer: asyncio.Future[bytes]) -> None:
        self.query_id, self.answer = query_id, answer

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if data[:2] == self.query_id and not self.answer.done():
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable
        if not self.answer.done():
            self.answer.set_exception(exc)
