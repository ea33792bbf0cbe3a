"""ASGI middleware that forwards sandbox-addressed HTTP requests to the guest.

Bodies stream in both directions with bounded buffering (one chunk in flight each way); a
request in flight is cut when its sandbox stops running, so that E2B SDKs see the connection
drop and then the proxy's 502 "not found" (their ``SandboxNotRunningException``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import httpx

from agentenv.envd_client import EnvdError
from agentenv.envd_client.transport import TARGET, GuestTransport, NoCookies
from agentenv.errors import NotFound, SandboxStateError
from agentenv.orchestrator import GUEST_UP, Orchestrator, SandboxRecord, State
from agentenv.proxy import websocket
from agentenv.proxy.envd_auth import carries_envd_credentials
from agentenv.proxy.headers import (
    NO_BODY,
    NO_BODY_HEADERS,
    SERVER_SUPPLIED,
    forwardable,
)

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
_T = TypeVar("_T")

ENVD_PORT = 49983
SWEEP_INTERVAL_S = 5.0  # how often the pools of sandboxes gone are closed
# envd's control routes, never reachable from outside (E2B's edge answers 404).
INTERNAL_ENVD_PATHS = frozenset({"/init", "/sync", "/port-forward", "/upgrade", "/freeze", "/unfreeze", "/collapse", "/fsfreeze", "/fsthaw"})


def envd_path_allowed(raw_path: bytes) -> bool:
    """Whether a path may be forwarded to the guest agent. Only the plain form the SDKs send
    passes: no empty, ``.`` or ``..`` segment and no percent-escape (file paths travel in the
    query). httpx and the agent would normalise anything else, so that ``/./init`` or
    ``//x/init`` reached a route that is the host's alone; and the host's routes never pass."""
    path = raw_path.decode("latin-1")
    if not path.startswith("/") or "%" in path or "//" in path:
        return False
    if any(seg in (".", "..") for seg in path.split("/")):
        return False
    return path not in INTERNAL_ENVD_PATHS


# Requests are made as httpx.Request, not with a client's build_request: that would add the
# client's default headers (an Accept-Encoding the client did not send makes servers in the
# sandbox compress, and the client get a body it did not ask for).
# Idle bounds as E2B's node proxy has them (620 s; SDK streams send a keepalive every 50 s):
# without one, a request whose client went while a guest did not read its body (or never
# answered) held its handler and a pool connection until the sandbox stopped.
IDLE_TIMEOUT_S = 620.0
# States a request resumes a sandbox from (auto-resume). RESUMING too: traffic that comes
# while another request's resume runs waits for it (connect takes the sandbox's lock).
WAKES = frozenset({State.PAUSING, State.PAUSED, State.RESUMING})
_TIMEOUTS = httpx.Timeout(connect=3.0, read=IDLE_TIMEOUT_S, write=IDLE_TIMEOUT_S, pool=30.0).as_dict()
_HOST_LABEL = re.compile(r"^(\d{1,5})-([a-z0-9]+)$")
_SANDBOX_ID = re.compile(r"^[a-z0-9]+$")


class _Reject(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message", ""))
        self.status = status
        self.body = body


class _ClientGone(Exception):
    """The client disconnected while sending the request body."""


def _refuse_host_routes(scope: Scope, port: int) -> bytes:
    """The request's raw path; 404 for one to the agent that ``envd_path_allowed`` refuses."""
    raw_path: bytes = scope.get("raw_path") or scope.get("path", "/").encode()
    if port == ENVD_PORT and not envd_path_allowed(raw_path):
        raise _Reject(404, {"code": 404, "message": "Not Found"})
    if not raw_path.startswith(b"/"):  # e.g. OPTIONS *: not a resource of the sandbox's server
        raise _Reject(400, {"code": 400, "message": "the request target must be a path starting with /"})
    return raw_path


def not_found(sandbox_id: str) -> _Reject:
    return _Reject(502, {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502})


def port_closed(sandbox_id: str, port: int) -> _Reject:
    return _Reject(502, {"sandboxId": sandbox_id, "message": "The sandbox is running but port is not open",
                         "port": port, "code": 502})


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class ProxyMiddleware:
    """ASGI middleware: sandbox-addressed requests go to the proxy, the rest to ``app``."""

    def __init__(self, app: ASGIApp, proxy: SandboxProxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        try:
            target = self.proxy.target(scope)
            if target is None:
                return await self.app(scope, receive, send)
            if scope["type"] == "websocket":
                await self.proxy.websocket(scope, receive, send, *target)
            else:
                await self.proxy.http(scope, receive, send, *target)
        except _Reject as r:
            if scope["type"] == "websocket":
                await websocket.reject(scope, send, r.status, r.body)
            else:
                await _send_json(send, r.status, r.body)
        return None


class SandboxProxy:
    """Forwards to sandbox ports. ``domain``: when set, Host routing only accepts ``*.{domain}``."""

    def __init__(self, orch: Orchestrator, domain: str | None = None, *,
                 dial_attempts: int = 5, dial_delay_s: float = 0.2, watch_interval_s: float = 0.25) -> None:
        self.orch = orch
        self.domain = domain.lower().rstrip(".") if domain else None
        self.dial_attempts = dial_attempts
        self.dial_delay_s = dial_delay_s
        self.watch_interval_s = watch_interval_s
        # One connection pool per sandbox: a new sandbox may get a killed one's address, and a
        # kept-alive connection to a VM that is gone is never closed by its peer.
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._sweeper: asyncio.Task[None] | None = None  # closes the pools of sandboxes gone
        self._gone: dict[str, tuple[asyncio.Event, int]] = {}
        self._watcher: asyncio.Task[None] | None = None

    # -- routing ------------------------------------------------------------------------------

    def target(self, scope: Scope) -> tuple[str, int] | None:
        """(sandbox id, port) this request is for, or None for the API. Raises _Reject (400)."""
        headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        # Host names are case-insensitive and may end in a dot. A domain with a port
        # (AENV_DOMAIN=localhost:8000, as a self-hosted E2B_DOMAIN often is) is matched with the
        # Host's port; any other, without it.
        hostname = headers.get(b"host", "").lower()
        if not (self.domain and ":" in self.domain) and not hostname.endswith("]"):
            hostname = hostname.rsplit(":", 1)[0]
        label, _, rest = hostname.partition(".")
        rest = rest.rstrip(".")
        m = _HOST_LABEL.match(label)
        if m and rest and (self.domain is None or rest == self.domain):
            return m.group(2), self._port(m.group(1))
        sid, port = headers.get(b"e2b-sandbox-id"), headers.get(b"e2b-sandbox-port")
        if sid is None and port is None:
            return None
        if not sid or not port:
            raise _Reject(400, {"code": 400, "message": "both E2b-Sandbox-Id and E2b-Sandbox-Port headers are required"})
        if not _SANDBOX_ID.match(sid):
            raise _Reject(400, {"code": 400, "message": f"invalid sandbox id '{sid}'"})
        return sid, self._port(port)

    @staticmethod
    def _port(value: str) -> int:
        if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 65535:  # "²" is a digit too
            raise _Reject(400, {"code": 400, "message": f"invalid sandbox port '{value}'"})
        return int(value)

    async def aclose(self) -> None:
        for task in (self._watcher, self._sweeper):
            if task:
                task.cancel()
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()

    async def _http_client(self, sandbox_id: str, port: int) -> httpx.AsyncClient:
        """The connection pool to that port of the sandbox. The agent's port shares the pool of
        the orchestrator's client of that sandbox: the connection its activation opened then
        carries the SDK's first command too (a new one into a TCG guest costs ~10 ms)."""
        if port == ENVD_PORT:
            try:
                return self.orch.envd(sandbox_id).http
            except (NotFound, SandboxStateError):
                raise not_found(sandbox_id) from None
        client = self._clients.get(sandbox_id)
        if client is None:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=16, keepalive_expiry=300.0)
            client = self._clients[sandbox_id] = httpx.AsyncClient(
                limits=limits, follow_redirects=False, trust_env=False, cookies=NoCookies(),
                verify=False,  # plain HTTP to the guest: no TLS context to build (~50 ms per client)
                transport=GuestTransport(limits))  # as the agent's port (envd_client/transport.py)
            if self._sweeper is None or self._sweeper.done():
                self._sweeper = asyncio.create_task(self._sweep(), name="proxy-sweep")
        return client

    async def _sweep(self) -> None:
        """Close the pools of sandboxes that stopped running (their kept-alive connections
        would stay open for good: a VM that is gone never closes them), also when no request
        comes for another sandbox; ends with the last pool."""
        while self._clients:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            # Pop before awaiting: a request meanwhile makes a new pool for a sandbox running again.
            stale = [self._clients.pop(s) for s in list(self._clients) if not self.running(s)]
            for c in stale:
                await c.aclose()

    async def dial(self, attempt: Callable[[], Awaitable[_T]], sandbox_id: str, port: int, *,
                   refused: type[Exception], timed_out: tuple[type[Exception], ...] = ()) -> _T:
        """``attempt`` a connection to a sandbox's port (HTTP and WebSocket alike). A port that
        refuses (a server may be starting) or times out is dialled again, ``dial_attempts``
        times ``dial_delay_s`` apart; a refused one first at once through the guest agent's
        forward, for a service that listens on the guest's loopback only. 502 "not found" once
        the sandbox stops running (its client may be closed by then), "port is not open" after
        the last attempt."""
        attempts, forwarded = self.dial_attempts, False
        while True:
            try:
                return await attempt()
            except (refused, *timed_out) as exc:
                if self.running(sandbox_id) is False:
                    raise not_found(sandbox_id) from None
                if not forwarded and isinstance(exc, refused) and await self.forward_loopback(sandbox_id, port):
                    forwarded = True
                    continue  # dial again now, through the guest's forward
                attempts -= 1
                if attempts <= 0:
                    raise port_closed(sandbox_id, port) from None
                await asyncio.sleep(self.dial_delay_s)
                if self.running(sandbox_id) is False:  # killed or paused meanwhile
                    raise not_found(sandbox_id) from None

    async def forward_loopback(self, sandbox_id: str, port: int) -> bool:
        """After a refused dial: ask the guest agent to forward ``port`` if a service listens on
        it on the guest's loopback only (as E2B's envd does). True once a forward is (newly) up."""
        if port == ENVD_PORT:
            return False
        try:
            return await self.orch.envd(sandbox_id).forward_port(port)
        except (EnvdError, NotFound, SandboxStateError):
            return False

    async def _lookup(self, sandbox_id: str, port: int, scope: Scope,
                      headers: dict[bytes, bytes]) -> tuple[str, dict[str, Any]]:
        try:
            rec = self.orch.get(sandbox_id)
        except NotFound:
            raise not_found(sandbox_id) from None
        # The traffic token before anything else: without it, a request must not even wake a
        # paused private sandbox.
        token = rec.options.get("trafficAccessToken")
        sent = headers.get(b"e2b-traffic-access-token", b"")
        if port != ENVD_PORT and token and not hmac.compare_digest(sent, str(token).encode("latin-1", "replace")):
            raise _Reject(403, {"code": 403, "message": f"sandbox {sandbox_id} is private: send its traffic access "
                                "token in the e2b-traffic-access-token header"})
        # The agent's own port wakes a sandbox only for a request the agent would accept
        # (checked only for a sandbox a request may wake: not on every request's path).
        if rec.state in WAKES and (port != ENVD_PORT or carries_envd_credentials(
                rec.access_token, scope.get("method", "GET"), scope.get("path", ""), scope.get("query_string", b""),
                headers)):
            await self._auto_resume(rec)
        try:
            addr = self.orch.guest_address(sandbox_id)
        except (NotFound, SandboxStateError):
            raise not_found(sandbox_id) from None
        return addr, rec.options.get("network") or {}

    @staticmethod
    def _upstream_host(port: int, net: dict[str, Any], headers: dict[bytes, bytes]) -> bytes | None:
        """The Host a sandbox's server sees: the sandbox's ``maskRequestHost`` (``${PORT}``
        filled in), else the client's; for the agent's port, its own address (None)."""
        if port == ENVD_PORT:
            return None
        mask = net.get("maskRequestHost")
        return mask.replace("${PORT}", str(port)).encode() if mask else headers.get(b"host")

    async def _auto_resume(self, rec: SandboxRecord) -> None:
        """Traffic for a paused sandbox (``rec``, in ``WAKES``) created with
        ``autoResume.enabled`` resumes it (with at least 300 s to live) before it is forwarded;
        any other paused sandbox is 502."""
        auto = rec.options.get("autoResume") or {}
        if isinstance(auto, dict) and auto.get("enabled"):
            log.info("traffic for paused sandbox %s: resuming it (autoResume)", rec.id)
            try:
                await self.orch.connect(rec.id, 300)
            except Exception as exc:  # noqa: BLE001 — the request then gets the usual 502
                log.warning("auto-resume of %s failed: %s", rec.id, exc)

    async def websocket(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        raw_path = _refuse_host_routes(scope, port)
        addr, net = await self._lookup(sandbox_id, port, scope, headers)
        await websocket.forward(self, scope, receive, send, addr, sandbox_id, port, raw_path,
                                self._upstream_host(port, net, headers))

    async def http(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str, port: int) -> None:
        raw_headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        headers = {k.lower(): v for k, v in raw_headers}
        raw_path = _refuse_host_routes(scope, port)
        addr, net = await self._lookup(sandbox_id, port, scope, headers)

        fwd = forwardable(raw_headers)
        if host := self._upstream_host(port, net, headers):
            fwd.append((b"host", host))
        url = f"http://{addr}:{port}{raw_path.decode('latin-1')}"
        target = raw_path  # what the guest gets, as the client sent it
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
            target += b"?" + scope["query_string"]
        has_body = b"content-length" in headers and headers[b"content-length"] != b"0" or b"transfer-encoding" in headers

        body_done = asyncio.Event()
        if not has_body:
            body_done.set()
        started = False

        async def request_body() -> AsyncIterator[bytes]:
            try:
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise _ClientGone
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        return
            finally:
                body_done.set()

        async def exchange() -> None:
            nonlocal started
            client = await self._http_client(sandbox_id, port)
            resp = None

            async def attempt() -> httpx.Response:
                req = httpx.Request(scope["method"], url, headers=fwd, extensions={"timeout": _TIMEOUTS, TARGET: target},
                                    content=request_body() if has_body else None)
                return await client.send(req, stream=True)

            resp = await self.dial(attempt, sandbox_id, port, refused=httpx.ConnectError, timed_out=(httpx.ConnectTimeout,))
            # The guest may answer before it read the whole body (httpcore then stops sending it):
            # from here on only the client's disconnect is awaited (client_gone).
            body_done.set()
            try:
                drop = SERVER_SUPPLIED | NO_BODY_HEADERS if resp.status_code in NO_BODY else SERVER_SUPPLIED
                out = forwardable(resp.headers.raw, drop)
                await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
                started = True
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
            finally:
                await resp.aclose()

        async def client_gone() -> None:
            await body_done.wait()
            while (await receive())["type"] != "http.disconnect":
                pass

        gone = self.subscribe(sandbox_id)
        work = asyncio.create_task(exchange())
        watchers = [asyncio.create_task(gone.wait()), asyncio.create_task(client_gone())]
        try:
            await asyncio.wait([work, *watchers], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                if gone.is_set():
                    if started:  # returning mid-response makes the server drop the connection
                        log.info("sandbox %s stopped running: cut a response to port %d", sandbox_id, port)
                        return
                    raise not_found(sandbox_id)
                return  # the client disconnected
            try:
                work.result()
            except _ClientGone:
                return
            except httpx.InvalidURL as exc:
                raise _Reject(400, {"code": 400, "message": f"cannot forward this request target: {exc}"}) from exc
            except httpx.TransportError as exc:
                if started:  # the head is sent: the server drops the connection
                    log.info("sandbox %s port %d: response cut: %s", sandbox_id, port, type(exc).__name__)
                    return
                if self.running(sandbox_id) is False:
                    raise not_found(sandbox_id) from exc
                raise _Reject(502, {"sandboxId": sandbox_id, "code": 502,
                                    "message": f"The request to port {port} of the sandbox failed: "
                                               f"{type(exc).__name__}"}) from exc
        finally:
            for w in watchers:
                w.cancel()
            self.unsubscribe(sandbox_id)

    # -- cutting requests to sandboxes that stop running -----------------------------------------

    def running(self, sandbox_id: str) -> bool:
        try:
            return self.orch.get(sandbox_id).state in GUEST_UP
        except NotFound:
            return False

    def subscribe(self, sandbox_id: str) -> asyncio.Event:
        ev, n = self._gone.get(sandbox_id, (asyncio.Event(), 0))
        if ev.is_set() and self.running(sandbox_id):
            # Set for an earlier run of the VM (a subscriber of that run has not left yet): a
            # request to the sandbox running again must not be cut at once.
            ev = asyncio.Event()
        self._gone[sandbox_id] = (ev, n + 1)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch(), name="proxy-watch")
        return ev

    def unsubscribe(self, sandbox_id: str) -> None:
        ev, n = self._gone[sandbox_id]
        if n <= 1:
            del self._gone[sandbox_id]
        else:
            self._gone[sandbox_id] = (ev, n - 1)

    async def _watch(self) -> None:
        while self._gone:
            await asyncio.sleep(self.watch_interval_s)
            for sid, (ev, _) in list(self._gone.items()):
                if not ev.is_set() and not self.running(sid):
                    ev.set()
