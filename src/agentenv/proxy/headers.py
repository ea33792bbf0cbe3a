"""Which headers the proxy passes on, in either direction (HTTP and WebSocket alike)."""

from __future__ import annotations

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host"})
# The platform's credentials and routing: never shown to code in the sandbox (a client that
# sends the node's API key along, as some gateways do, must not hand it to the guest).
PLATFORM_HEADERS = frozenset({b"x-api-key", b"e2b-traffic-access-token", b"e2b-sandbox-id", b"e2b-sandbox-port"})
# Responses that never have a body: a Content-Length on them describes another response.
NO_BODY = frozenset({204, 304})
NO_BODY_HEADERS = frozenset({b"content-length"})
# Response headers the ASGI server adds to every response itself (uvicorn: Date; its Server
# header is turned off in server.py, so the guest's own Server goes through): passed on, the
# client would get two.
SERVER_SUPPLIED = frozenset({b"date"})


def forwardable(raw_headers: list[tuple[bytes, bytes]], drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """The end-to-end headers of a message: without hop-by-hop ones (including those its
    Connection header names), the platform's own, and ``drop``."""
    named = {t.strip().lower() for k, v in raw_headers if k.lower() == b"connection" for t in v.split(b",")}
    return [(k, v) for k, v in raw_headers
            if (lk := k.lower()) not in HOP_BY_HOP and lk not in PLATFORM_HEADERS and lk not in named and lk not in drop]
