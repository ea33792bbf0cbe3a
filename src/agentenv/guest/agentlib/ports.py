"""Services that listen on the guest's loopback only, made reachable from the host.

Many servers bind 127.0.0.1 by default (dev servers, notebooks). E2B's envd forwards such
ports to the sandbox's external address so that ``get_host(port)`` reaches them; here the
forward is made on demand: when the host's proxy finds a port closed it asks ``POST
/port-forward?port=N`` (host only, like ``/init``), and if a loopback listener is there, the
agent accepts on the address the host dials and relays each connection to it. Nothing is
polled while no forward exists, so an idle sandbox spends no CPU on this; while forwards
exist, their listeners are checked every WATCH_S and a forward whose listener is gone is
closed (it would otherwise hold the port against a server started again on 0.0.0.0).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

from .common import log

LISTEN = "0A"  # TCP state in /proc/net/tcp*
_LOOPBACK = {
    "/proc/net/tcp": ("0100007F", "127.0.0.1"),
    "/proc/net/tcp6": ("00000000000000000000000001000000", "::1"),
}
_RELAY_CHUNK = 64 * 1024
WATCH_S = 1.0


def loopback_listener(port: int) -> str | None:
    """The loopback address a TCP server listens on at ``port`` (127.0.0.1 or ::1), or None."""
    for table, (hex_addr, addr) in _LOOPBACK.items():
        try:
            with open(table) as f:
                next(f, None)  # header
                for line in f:
                    fields = line.split()
                    local, st = fields[1], fields[3]
                    host, _, hex_port = local.partition(":")
                    if st == LISTEN and host == hex_addr and int(hex_port, 16) == port:
                        return addr
        except OSError:
            continue
    return None


class PortForwarder:
    """One relay server per forwarded port, bound to the address the host reaches the guest at."""

    def __init__(self) -> None:
        self._servers: dict[int, asyncio.Server] = {}
        self._watcher: asyncio.Task | None = None

    async def ensure(self, port: int, bind: str) -> bool:
        """Forward ``bind:port`` to the loopback listener on ``port``; False if there is none."""
        if port in self._servers:
            return True
        target = loopback_listener(port)
        if target is None:
            return False
        try:
            server = await asyncio.start_server(
                lambda r, w: self._relay(port, target, r, w), bind, port, reuse_address=True)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # something listens there already: nothing to do
                return True
            raise
        self._servers[port] = server
        log(f"forwarding {bind}:{port} to {target}:{port} (a loopback-only listener)")
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        return True

    async def _watch(self) -> None:
        """Close forwards whose listener is gone; ends with the last forward."""
        while self._servers:
            await asyncio.sleep(WATCH_S)
            for port in list(self._servers):
                if loopback_listener(port) is None:
                    self._close(port)

    async def _relay(self, port: int, target: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target, port)
        except OSError:
            writer.close()
            if loopback_listener(port) is None:  # the service went away: so does its forward
                self._close(port)
            return
        with contextlib.suppress(OSError):
            up_writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)
        writer.close()
        up_writer.close()

    def _close(self, port: int) -> None:
        server = self._servers.pop(port, None)
        if server is not None:
            server.close()
            log(f"stopped forwarding port {port}: nothing listens on it any more")


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close (so request/response protocols see the end)."""
    try:
        while data := await src.read(_RELAY_CHUNK):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, OSError):
        dst.close()
