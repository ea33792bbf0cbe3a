"""The host's HTTP clients of a guest (the orchestrator's envd client, the proxy's pool of a
sandbox port) keep no cookies: httpx kept every Set-Cookie a guest's server sent, one per
path for a cookie without Path, in the server's memory for the sandbox's lifetime."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agentenv.envd_client import EnvdClient
from agentenv.proxy.http import SandboxProxy


class _SetsCookies(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        self.send_response(200)
        self.send_header("Set-Cookie", f"c{self.path.replace('/', '_')}=v")
        self.send_header("Set-Cookie", "session=abc")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def guest_server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SetsCookies)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


async def _get_many(client: httpx.AsyncClient, base: str) -> None:
    for i in range(50):
        r = await client.send(httpx.Request("GET", f"{base}/dir{i}/page"))
        await r.aread()
        assert r.status_code == 200 and "set-cookie" in r.headers


async def test_the_envd_client_of_a_guest_keeps_no_cookies(guest_server: str) -> None:
    client = EnvdClient.for_guest(guest_server)
    try:
        await _get_many(client.http, guest_server)
        assert len(client.http.cookies.jar) == 0
    finally:
        await client.aclose()


async def test_the_proxys_pool_of_a_sandbox_port_keeps_no_cookies(guest_server: str) -> None:
    proxy = SandboxProxy(orch=None)  # type: ignore[arg-type] — a non-envd port needs no orchestrator
    try:
        client = await proxy._http_client("sbx", 8080)
        await _get_many(client, guest_server)
        assert len(client.cookies.jar) == 0
    finally:
        await proxy.aclose()
