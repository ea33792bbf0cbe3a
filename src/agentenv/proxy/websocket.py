"""WebSocket pass-through to a sandbox port (after the same routing and checks as HTTP)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
    ProtocolError,
)
from websockets.uri import parse_uri

from agentenv.proxy.headers import forwardable

if TYPE_CHECKING:
    from agentenv.proxy.http import Receive, SandboxProxy, Scope, Send

CLOSE_TIMEOUT_S = 5.0
# A message is relayed whole (ASGI has no fragments), so it is held in the server's memory:
# bounded as uvicorn bounds the client's (ws_max_size). A guest's larger message ends the
# connection with 1009, both ways, instead of a program in a sandbox growing the server.
MAX_MESSAGE_BYTES = 16 << 20
# Handshake headers the upstream client makes itself.
_OWN = frozenset({b"host", b"connection", b"upgrade", b"sec-websocket-key", b"sec-websocket-version",
                  b"sec-websocket-extensions", b"sec-websocket-protocol", b"content-length", b"transfer-encoding"})


async def reject(scope: Scope, send: Send, status: int, body: dict[str, Any]) -> None:
    """Refuse before the handshake: with an HTTP answer (E2B's JSON) where the server supports
    it, else a close (the client sees 403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        data = json.dumps(body).encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "websocket.http.response.body", "body": data})
    else:
        await send({"type": "websocket.close", "code": 1011, "reason": str(body.get("message", ""))[:120]})


class _Dial(connect):
    """A dial that follows no redirect: a guest answering the upgrade with a 3xx must not make
    the server connect elsewhere (the host's services, another sandbox's ports) and relay it,
    with the client's headers."""

    def process_redirect(self, exc: Exception) -> Exception:
        return exc


async def forward(proxy: SandboxProxy, scope: Scope, receive: Receive, send: Send, addr: str,
                  sandbox_id: str, port: int, raw_path: bytes, host: bytes | None = None) -> None:
    """``host``: the Host the sandbox's server is to see (the client's, or the sandbox's
    ``maskRequestHost``), as over HTTP; None: the guest's address."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in forwardable(scope.get("headers", []), _OWN)]
    qs = scope.get("query_string", b"").decode("latin-1")
    # The path as the client sent it: decoded, %3F would become a query and %2F a separator.
    target = raw_path.decode("latin-1") + (f"?{qs}" if qs else "")
    url = _url_with_host(host, target) or f"ws://{addr}:{port}{target}"
    if (await receive())["type"] != "websocket.connect":
        return

    async def dial() -> ClientConnection:
        # The TCP connection goes to the guest (host/port), the Host header is the URL's.
        # max_queue=1: one relayed message held while the other side is slow, not sixteen.
        return await _Dial(url, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                           max_size=MAX_MESSAGE_BYTES, max_queue=1, open_timeout=10, ping_interval=None,
                           compression=None, proxy=None, host=addr, port=port)

    try:
        # (A port that stays closed, or a sandbox that stops, is refused by the proxy's dial.)
        up = await proxy.dial(dial, sandbox_id, port, refused=ConnectionRefusedError)
    except (OSError, InvalidHandshake, TimeoutError) as exc:
        if isinstance(exc, InvalidStatus):
            status = exc.response.status_code
            await reject(scope, send, status, {"code": status, "message": f"the sandbox's server answered {status}"})
        elif not proxy.running(sandbox_id):
            await reject(scope, send, 502, {"sandboxId": sandbox_id, "message": "The sandbox was not found",
                                            "code": 502})
        else:
            await reject(scope, send, 502, {"sandboxId": sandbox_id, "code": 502, "port": port,
                                            "message": "The sandbox is running but port is not open"})
        return
    async with up:
        await send({"type": "websocket.accept", "subprotocol": up.subprotocol})

        async def client_to_sandbox() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "websocket.disconnect":
                    await _close_like(up, msg.get("code", 1005), msg.get("reason") or "")
                    return
                if msg.get("bytes") is not None:
                    await up.send(msg["bytes"])
                elif msg.get("text") is not None:
                    await up.send(msg["text"])

        async def sandbox_to_client() -> None:
            code, reason = None, ""
            try:
                async for data in up:
                    key = "bytes" if isinstance(data, bytes) else "text"
                    await send({"type": "websocket.send", key: data})
            except ConnectionClosed as exc:
                if exc.rcvd is None and exc.sent is not None:  # ended by us: 1009 for a message too big
                    code, reason = exc.sent.code, exc.sent.reason
            if code is None:
                code, reason = up.close_code or 1000, up.close_reason or ""
            if code in (1006, 1015):  # the guest's connection dropped: no endpoint sends these
                return  # ending the handler drops the client's connection likewise
            # A close frame without a code (1005) cannot be relayed as such: a normal close.
            await send({"type": "websocket.close", "code": 1000 if code == 1005 else code, "reason": reason})

        gone = proxy.subscribe(sandbox_id)
        tasks = [asyncio.create_task(client_to_sandbox()), asyncio.create_task(sandbox_to_client()),
                 asyncio.create_task(gone.wait())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            proxy.unsubscribe(sandbox_id)
        if tasks[2] in done:  # the sandbox stopped running: end the client's side too
            # Bounded: a client that reads nothing must not hold this handler (and its slot).
            try:
                await asyncio.wait_for(send({"type": "websocket.close", "code": 1011,
                                             "reason": "The sandbox was not found"}), CLOSE_TIMEOUT_S)
            except (TimeoutError, OSError):
                pass


async def _close_like(up: ClientConnection, code: int, reason: str) -> None:
    """End the sandbox's side as the client ended the proxy's: its close code and reason, a close
    frame without a code (1005; uvicorn reports a lost connection so too), or a dropped
    connection (1006). Codes no endpoint may send (RFC 6455 §7.4) become a plain close."""
    if code == 1006:
        up.transport.abort()
        return
    try:
        await up.close(None if code == 1005 else code, reason if code != 1005 else "")  # type: ignore[arg-type]
    except ProtocolError:
        await up.close()


def _url_with_host(host: bytes | None, target: str) -> str | None:
    """``ws://<host><target>``, where the dial's Host header comes from, if ``host`` is a
    valid one; else None (the guest's address is used)."""
    if not host:
        return None
    url = f"ws://{host.decode('latin-1')}{target}"
    try:
        parse_uri(url)
    except InvalidURI:
        return None
    return url

