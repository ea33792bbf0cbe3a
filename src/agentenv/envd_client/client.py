"""Async client for the envd protocol spoken by the AgentENV guest agent (and by E2B's envd).

The orchestrator keeps one :class:`EnvdClient` per sandbox. It holds a single persistent
``httpx.AsyncClient`` so that consecutive calls reuse a kept-alive TCP connection: an exec round trip
should cost a few milliseconds, not a TCP handshake each time.

Wire format (see the E2B wire-protocol reference, section 4): Connect RPC with the JSON codec over
HTTP/1.1. Unary calls POST a JSON message and get a JSON answer (errors: non-200 with
``{"code": "<connect code>", "message": ...}``). Server streams POST one 5-byte-framed envelope
(``flags u8 | length u32 BE | JSON``) and read a sequence of envelopes terminated by an
end-of-stream envelope (flag ``0x02``) that may carry an error.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import os
import struct
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import httpx

from agentenv.envd_client.transport import GuestTransport, NoCookies

__all__ = ["CommandResult", "EnvdClient", "EnvdError", "EnvdUnavailable", "MAX_MESSAGE_BYTES", "ProcessEvent"]

# HTTP status -> Connect code, for plain (non-Connect) error responses (reference §3.4).
_STATUS_CODES = {
    400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
    409: "already_exists", 413: "resource_exhausted", 429: "resource_exhausted", 499: "canceled",
    500: "internal", 501: "unimplemented", 502: "unavailable", 503: "unavailable",
    504: "deadline_exceeded", 505: "unimplemented", 507: "resource_exhausted",
}
_END_STREAM = 0x02
# The agent sends a keepalive after this many idle seconds on process streams; we give up on a
# stream that stays silent for several intervals (a dead VM never closes the TCP connection).
_KEEPALIVE_S = 20
_STREAM_READ_TIMEOUT_S = 4 * _KEEPALIVE_S
# The most this client takes from a guest in one answer or one stream message. What a guest
# sends is the sandbox's to choose (a program in it can replace the agent): without a bound, one
# declared length of 4 GiB would grow the server's memory for every sandbox on the node. The
# agent's own answers are far smaller (output comes in chunks of tens of KiB).
MAX_MESSAGE_BYTES = 16 << 20
# Of an error answer, only the start is kept (its message is cut to 500 characters).
_MAX_ERROR_BYTES = 64 << 10

OutputCallback = Callable[[bytes], "Awaitable[None] | None"]


class EnvdError(Exception):
    """An error reported by envd (or derived from an HTTP status). ``code`` is a Connect code
    such as ``not_found``, ``deadline_exceeded`` or ``unauthenticated``."""

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


class EnvdUnavailable(EnvdError):
    """The agent could not be reached (connection refused/reset, timeout, VM gone)."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


@dataclass(frozen=True)
class CommandResult:
    """Outcome of :meth:`EnvdClient.run`. ``exit_code`` is -1 when a signal killed the process;
    ``error`` is envd's error text (``"exit status 1"``, ``"signal: killed"``) or None."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    pid: int
    error: str | None


@dataclass(frozen=True)
class ProcessEvent:
    """One event of a process stream.

    ``type`` is ``"start"`` (``pid`` set), ``"stdout"``/``"stderr"``/``"pty"`` (``data`` set) or
    ``"end"`` (``exit_code``, ``exited``, ``status``, ``error`` set). Keepalives are not surfaced.
    """

    type: str
    pid: int = 0
    data: bytes = b""
    exit_code: int = 0
    exited: bool = False
    status: str = ""
    error: str | None = None


@dataclass(frozen=True)
class _Answer:
    """A whole (bounded) answer of the agent."""

    status_code: int
    content: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.content)
        except ValueError as exc:
            raise EnvdError("internal", f"malformed answer from the guest agent: {exc}") from exc


@contextlib.contextmanager
def _transport_errors(what: str) -> Iterator[None]:
    """httpx's transport failures (refused, reset, timed out: a VM gone) as EnvdUnavailable
    naming ``what``."""
    try:
        yield
    except httpx.TransportError as exc:
        raise EnvdUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


def _too_large(what: str, limit: int) -> EnvdError:
    return EnvdError("resource_exhausted", f"{what}: the guest agent's answer passed {limit} bytes "
                                           f"(a sandbox may send at most that much in one message)")


async def _read_capped(resp: httpx.Response, limit: int | None, what: str) -> bytes:
    """The body of a streamed response, refused once it passes ``limit`` bytes."""
    if limit is not None and int(resp.headers.get("content-length") or 0) > limit:
        raise _too_large(what, limit)
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if limit is not None and len(body) > limit:
            raise _too_large(what, limit)
    return bytes(body)


async def _read_error(resp: httpx.Response) -> bytes:
    """The start of an error answer's body (all its message needs); the rest is not read."""
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) >= _MAX_ERROR_BYTES:
            break
    return bytes(body[:_MAX_ERROR_BYTES])


def _parse_event(message: dict) -> ProcessEvent | None:
    event = message.get("event") or {}
    if "start" in event:
        return ProcessEvent("start", pid=int(event["start"].get("pid", 0)))
    if "data" in event:
        (kind, b64), = event["data"].items()
        return ProcessEvent(kind, data=base64.b64decode(b64))
    if "end" in event:
        end = event["end"]
        return ProcessEvent("end", exit_code=int(end.get("exitCode", 0)), exited=bool(end.get("exited")),
                            status=end.get("status", ""), error=end.get("error"))
    return None  # keepalive or an event type this client does not know


def _envelope(message: dict) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(data)) + data


def _error_from_body(status: int, body: bytes) -> EnvdError:
    """Turn a non-2xx response into an EnvdError (Connect string codes or envd's integer codes)."""
    code, message = _STATUS_CODES.get(status, "unknown"), body.decode(errors="replace")[:500]
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        message = str(obj.get("message", message))
        if isinstance(obj.get("code"), str):
            code = obj["code"]
        elif isinstance(obj.get("code"), int):
            code = _STATUS_CODES.get(obj["code"], code)
    return EnvdError(code, message, status)


def _check_end_stream(body: bytes, method: str) -> None:
    """Raise the error of a fully read Connect stream's end-of-stream envelope, if any."""
    while len(body) >= 5:
        flags, length = struct.unpack(">BI", body[:5])
        payload, body = body[5:5 + length], body[5 + length:]
        if flags & _END_STREAM:
            error = json.loads(payload or b"{}").get("error")
            if error:
                raise EnvdError(error.get("code", "unknown"), error.get("message", ""))
            return
    raise EnvdUnavailable(f"{method}: stream ended without an end-of-stream message")


async def _call(callback: OutputCallback | None, data: bytes) -> None:
    if callback is not None:
        result = callback(data)
        if inspect.isawaitable(result):
            await result


class EnvdClient:
    """Talks to one guest agent at ``base_url`` (``http://<ip>:49983``)."""

    def __init__(self, base_url: str, access_token: str | None = None, timeout: float = 30.0, *,
                 headers: dict[str, str] | None = None, trust_env: bool = True, guest: bool = False) -> None:
        """``headers`` go with every request: e.g. ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` to reach an
        envd through a sandbox proxy at ``base_url``. ``trust_env=False`` ignores HTTP(S)_PROXY."""
        self.base_url = base_url.rstrip("/")
        self.access_token = access_token
        self.timeout = timeout
        # 256: the sandbox proxy shares this pool, and every streamed command or watch of an
        # SDK holds a connection while it lasts.
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=16, keepalive_expiry=300.0)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout),
            limits=limits,
            headers=headers, trust_env=trust_env, cookies=NoCookies(),
            # Plain HTTP (a guest, or a server without TLS) needs no TLS context: building the
            # default one (loading the CA bundle) costs ~50 ms, on every sandbox's first request.
            verify=self.base_url.startswith("https:"),
            # A guest, straight: httpcore on plain asyncio (transport.py), not on anyio.
            transport=GuestTransport(limits) if guest else None,
        )

    @classmethod
    def for_guest(cls, url: str, access_token: str | None = None) -> EnvdClient:
        """A client for a sandbox's agent, reached directly on its host-side address: never
        through an HTTP(S)_PROXY the server's environment may name."""
        return cls(url, access_token, trust_env=False, guest=True)

    @property
    def http(self) -> httpx.AsyncClient:
        """The connection pool to the agent, for pass-through traffic (the sandbox proxy), so
        that a connection this client opened serves the next SDK request as well. Requests made
        as ``httpx.Request`` and sent with ``send`` carry none of this client's headers."""
        return self._http

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EnvdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- plumbing ---------------------------------------------------------------------------

    def _headers(self, user: str | None = None, **extra: str) -> dict[str, str]:
        headers = dict(extra)
        if self.access_token:
            headers["X-Access-Token"] = self.access_token
        if user:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return headers

    async def _request(self, method: str, path: str, *, limit: int | None = MAX_MESSAGE_BYTES,
                       **kwargs: Any) -> _Answer:
        """A request and its whole answer, of at most ``limit`` bytes (None: no bound)."""
        what = f"{method} {self.base_url}{path}"
        timeout = kwargs.pop("timeout", httpx.USE_CLIENT_DEFAULT)
        request = self._http.build_request(method, path, timeout=timeout, **kwargs)
        resp = await self._send(request, what)
        try:
            with _transport_errors(what):
                body = await (_read_capped(resp, limit, what) if 200 <= resp.status_code < 300 else _read_error(resp))
        finally:
            await resp.aclose()
        return _Answer(resp.status_code, body)

    async def _send(self, request: httpx.Request, what: str) -> httpx.Response:
        """Send with a streamed response body (the caller closes it); transport failures
        become EnvdUnavailable."""
        with _transport_errors(what):
            return await self._http.send(request, stream=True)

    async def rpc(self, method: str, message: dict, user: str | None = None) -> dict:
        """A unary Connect call, e.g. ``rpc("filesystem.Filesystem/Stat", {"path": "/"})``."""
        resp = await self._request(
            "POST", f"/{method}", content=json.dumps(message).encode(),
            headers=self._headers(user, **{"Content-Type": "application/json", "Connect-Protocol-Version": "1",
                                           "Connect-Timeout-Ms": str(int(self.timeout * 1000))}))
        if resp.status_code != 200:
            raise _error_from_body(resp.status_code, resp.content)
        return resp.json()

    async def _send_stream(self, request: httpx.Request, what: str) -> httpx.Response:
        """Send with a streamed response body; transport failures become EnvdUnavailable and a
        non-200 answer its EnvdError (the response is closed then). The caller closes it otherwise."""
        resp = await self._send(request, what)
        if resp.status_code != 200:
            try:
                with _transport_errors(what):
                    body = await _read_error(resp)
            finally:
                await resp.aclose()
            raise _error_from_body(resp.status_code, body)
        return resp

    async def _server_stream(self, method: str, message: dict, user: str | None,
                             timeout: float | None) -> AsyncIterator[dict]:
        """A server-streaming Connect call; yields decoded messages, raises on an error end."""
        headers = self._headers(user, **{
            "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
            "Keepalive-Ping-Interval": str(_KEEPALIVE_S)})
        if timeout:
            headers["Connect-Timeout-Ms"] = str(max(1, int(timeout * 1000)))
        request = self._http.build_request(
            "POST", f"/{method}", content=_envelope(message), headers=headers,
            timeout=httpx.Timeout(self.timeout, read=_STREAM_READ_TIMEOUT_S))
        resp = await self._send_stream(request, method)
        try:
            with _transport_errors(method):
                buf = bytearray()
                chunks = resp.aiter_bytes()
                async for chunk in chunks:
                    buf += chunk
                    while len(buf) >= 5:
                        flags, length = struct.unpack(">BI", buf[:5])
                        if length > MAX_MESSAGE_BYTES:
                            raise _too_large(method, MAX_MESSAGE_BYTES)
                        if len(buf) < 5 + length:
                            break
                        payload = json.loads(bytes(buf[5:5 + length]))
                        del buf[:5 + length]
                        if flags & _END_STREAM:
                            # Read the body to its end (the chunked terminator is normally in the
                            # same packet) so the connection goes back to the pool: closing it
                            # unread would make the next call open a new one, ~10 ms into a TCG guest.
                            async for _ in chunks:
                                pass
                            error = payload.get("error")
                            if error:
                                raise EnvdError(error.get("code", "unknown"), error.get("message", ""))
                            return
                        yield payload
                raise EnvdUnavailable(f"{method}: stream ended without an end-of-stream message")
        except ValueError as exc:  # undecodable JSON in an envelope
            raise EnvdError("internal", f"{method}: malformed stream message: {exc}") from exc
        finally:
            await resp.aclose()

    # ---- lifecycle --------------------------------------------------------------------------

    async def health(self, timeout: float = 1.0) -> bool:
        """True if ``GET /health`` answers 2xx; False on connection errors or other statuses."""
        return await self._probe(timeout) is None

    async def _probe(self, timeout: float) -> str | None:
        """None when healthy, else why not (for error messages)."""
        try:
            resp = await self._http.get("/health", timeout=timeout)
        except httpx.TransportError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return None if 200 <= resp.status_code < 300 else f"HTTP {resp.status_code}"

    async def answers_within(self, bound_s: float) -> bool:
        """Whether ``/health`` answers within ``bound_s``: each probe may take all the time
        left (an agent slowed by a loaded host still counts), and one that fails at once (a
        restarting agent refuses, a stale connection breaks) is asked again until then."""
        deadline = time.monotonic() + bound_s
        while True:
            if await self.health(timeout=max(0.05, deadline - time.monotonic())):
                return True
            if time.monotonic() >= deadline - 0.2:
                return False
            await asyncio.sleep(0.2)

    async def wait_healthy(self, deadline_s: float) -> None:
        """Poll /health until it succeeds; raise EnvdUnavailable after ``deadline_s`` seconds."""
        start = time.monotonic()
        delay = 0.01
        while True:
            left = deadline_s - (time.monotonic() - start)
            problem = await self._probe(timeout=max(0.05, min(1.0, left)))
            if problem is None:
                return
            left = deadline_s - (time.monotonic() - start)
            if left <= 0:
                raise EnvdUnavailable(f"guest agent at {self.base_url} did not become healthy within "
                                      f"{deadline_s:.1f}s (last probe: {problem})")
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.2)

    async def init(self, *, sandbox_id: str, template_id: str, env_vars: dict[str, str],
                   access_token: str | None, hostname: str | None = None, default_user: str | None = None,
                   default_workdir: str | None = None) -> None:
        """``POST /init``: identity, env vars, access token, current clock and fresh entropy.
        Call after boot and after every snapshot restore. Later calls use ``access_token``."""
        body: dict[str, Any] = {
            "sandboxId": sandbox_id, "templateId": template_id, "envVars": env_vars,
            "accessToken": access_token, "timestamp": time.time(),
            "entropy": base64.b64encode(os.urandom(32)).decode(),
        }
        if hostname:
            body["hostname"] = hostname
        if default_user:
            body["defaultUser"] = default_user
        if default_workdir:
            body["defaultWorkdir"] = default_workdir
        await self._post_init(body)
        self.access_token = access_token

    async def _post_init(self, body: dict[str, Any]) -> None:
        resp = await self._request("POST", "/init", json=body, headers=self._headers())
        if not 200 <= resp.status_code < 300:
            raise _error_from_body(resp.status_code, resp.content)

    async def sync(self, timeout: float) -> None:
        """``POST /sync``: the guest writes every dirty page of its filesystems to its disk, so
        that the disk alone holds the sandbox's files (a filesystem-only pause)."""
        resp = await self._request("POST", "/sync", headers=self._headers(), timeout=timeout)
        if not 200 <= resp.status_code < 300:
            raise _error_from_body(resp.status_code, resp.content)

    async def warm_up(self) -> None:
        """A trivial command as the default user and as root, the way SDKs run commands
        (``bash -l -c``; the agent falls back to the image's sh, or its own when the image has
        no shell): its code paths get translated (TCG) and paged in before a user needs them."""
        for user in (None, "root"):
            res = await self.run(["/bin/bash", "-l", "-c", "true"], user=user)
            if res.exit_code != 0:
                raise EnvdError("internal", f"warm-up command failed as {user or 'the default user'}: "
                                            f"exit {res.exit_code}: {res.stderr[-300:].decode(errors='replace')}")

    async def resume(self, env_vars: dict[str, str] | None = None, template_id: str | None = None) -> None:
        """``POST /init`` with the current clock (and env vars) only: for a guest that already
        has its identity and was frozen since (a primed warm-pool sandbox). ``template_id``:
        the name it is handed out under, if that may have changed since it was primed."""
        body: dict[str, Any] = {"timestamp": time.time()}
        if env_vars:
            body["envVars"] = env_vars
        if template_id:
            body["templateId"] = template_id
        await self._post_init(body)

    async def configure(self, *, env_vars: dict[str, str] | None = None, default_user: str | None = None,
                        default_workdir: str | None = None) -> None:
        """``POST /init`` with env vars, default user and default workdir only (no identity,
        clock or token change): what a template build leaves in the agent's memory."""
        body: dict[str, Any] = {"envVars": dict(env_vars or {})}
        if default_user:
            body["defaultUser"] = default_user
        if default_workdir:
            body["defaultWorkdir"] = default_workdir
        await self._post_init(body)

    # ---- processes --------------------------------------------------------------------------

    async def stream(self, cmd: str | list[str], *, envs: dict[str, str] | None = None,
                     cwd: str | None = None, user: str | None = None, timeout: float | None = None,
                     stdin: bool = False, tag: str | None = None,
                     pty: tuple[int, int] | None = None) -> AsyncIterator[ProcessEvent]:
        """Start a process and yield its events: ``start``, ``stdout``/``stderr`` chunks, ``end``.

        A ``str`` runs as ``/bin/bash -l -c cmd``; a list is the argv. ``timeout`` (seconds) is the
        process lifetime: the agent kills it and the stream raises ``EnvdError("deadline_exceeded")``.
        ``pty=(cols, rows)`` runs it on a pseudo-terminal of that size: output then comes as ``pty``
        chunks and input goes with :meth:`send_pty` / ``stream_input(pty=True)``.
        Abandoning the iteration disconnects but does not kill the process.
        """
        argv = ["/bin/bash", "-l", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("empty command")
        process: dict[str, Any] = {"cmd": argv[0], "args": argv[1:], "envs": envs or {}}
        if cwd:
            process["cwd"] = cwd
        message: dict[str, Any] = {"process": process, "stdin": stdin}
        if pty is not None:
            message["pty"] = {"size": {"cols": int(pty[0]), "rows": int(pty[1])}}
        if tag:
            message["tag"] = tag
        async with aclosing(self._server_stream("process.Process/Start", message, user, timeout)) as payloads:
            async for payload in payloads:
                if (event := _parse_event(payload)) is not None:
                    yield event

    async def connect(self, pid: int, timeout: float | None = None) -> AsyncIterator[ProcessEvent]:
        """Re-attach to a running (or recently finished) process: ``start``, further output, ``end``."""
        message = {"process": {"pid": pid}}
        async with aclosing(self._server_stream("process.Process/Connect", message, None, timeout)) as payloads:
            async for payload in payloads:
                if (event := _parse_event(payload)) is not None:
                    yield event

    async def run(self, cmd: str | list[str], *, envs: dict[str, str] | None = None,
                  cwd: str | None = None, user: str | None = None, timeout: float | None = None,
                  on_stdout: OutputCallback | None = None,
                  on_stderr: OutputCallback | None = None, max_output: int | None = None) -> CommandResult:
        """Run a command to completion, collecting output (callbacks get chunks as they arrive).
        A non-zero exit is a normal result, not an exception. ``max_output``: the bytes of
        each stream kept in memory; a command that writes more (``yes``, ``cat /dev/zero``:
        a program in the sandbox chooses) is killed, its result keeps the first bytes and
        says why in ``error``."""
        pid, stdout, stderr = 0, bytearray(), bytearray()
        result: CommandResult | None = None
        cut: str | None = None
        async with aclosing(self.stream(cmd, envs=envs, cwd=cwd, user=user, timeout=timeout)) as events:
            async for event in events:
                if event.type == "start":
                    pid = event.pid
                elif event.type in ("stdout", "stderr"):
                    kept = stdout if event.type == "stdout" else stderr
                    room = len(event.data) if max_output is None else max(0, max_output - len(kept))
                    kept += event.data[:room]
                    await _call(on_stdout if event.type == "stdout" else on_stderr, event.data)
                    if room < len(event.data) and cut is None:
                        cut = (f"its {event.type} passed {max_output} bytes: the command was killed "
                               f"(stream its output for more)")
                        await self.send_signal(pid, "SIGKILL")
                elif event.type == "end":
                    result = CommandResult(event.exit_code, bytes(stdout), bytes(stderr), pid, cut or event.error)
        if result is None:
            raise EnvdError("internal", "process stream ended without an end event")
        return result

    async def list_processes(self) -> list[dict]:
        """Running processes started through the agent: ``[{"config": {...}, "pid": N, "tag"?: ...}]``."""
        return (await self.rpc("process.Process/List", {})).get("processes", [])

    async def send_signal(self, pid: int, signal: str = "SIGKILL") -> bool:
        """Send ``SIGKILL``/``SIGTERM``; False when no such process is running."""
        try:
            await self.rpc("process.Process/SendSignal", {"process": {"pid": pid}, "signal": f"SIGNAL_{signal}"})
        except EnvdError as exc:
            if exc.code == "not_found":
                return False
            raise
        return True

    async def send_stdin(self, pid: int, data: bytes) -> None:
        await self.rpc("process.Process/SendInput",
                       {"process": {"pid": pid}, "input": {"stdin": base64.b64encode(data).decode()}})

    async def send_pty(self, pid: int, data: bytes) -> None:
        """Type ``data`` into the PTY of a process started with ``pty=``."""
        await self.rpc("process.Process/SendInput",
                       {"process": {"pid": pid}, "input": {"pty": base64.b64encode(data).decode()}})

    async def resize_pty(self, pid: int, cols: int, rows: int) -> None:
        """``process.Process/Update``: resize the PTY (the process gets SIGWINCH)."""
        await self.rpc("process.Process/Update",
                       {"process": {"pid": pid}, "pty": {"size": {"cols": int(cols), "rows": int(rows)}}})

    async def close_stdin(self, pid: int) -> None:
        await self.rpc("process.Process/CloseStdin", {"process": {"pid": pid}})

    async def stream_input(self, pid: int, chunks: AsyncIterator[bytes], pty: bool = False) -> None:
        """``process.Process/StreamInput``: send ``chunks`` to the process's stdin (or its PTY) in
        order, over one client-streaming call; returns when the agent has taken all of them."""
        kind = "pty" if pty else "stdin"

        async def body() -> AsyncIterator[bytes]:
            yield _envelope({"start": {"process": {"pid": pid}}})
            async for chunk in chunks:
                yield _envelope({"data": {"input": {kind: base64.b64encode(chunk).decode()}}})

        request = self._http.build_request(
            "POST", "/process.Process/StreamInput", content=body(),
            headers=self._headers(**{"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}),
            timeout=httpx.Timeout(self.timeout, write=None))
        resp = await self._send_stream(request, "process.Process/StreamInput")
        try:
            with _transport_errors("process.Process/StreamInput"):
                body_bytes = await _read_capped(resp, MAX_MESSAGE_BYTES, "process.Process/StreamInput")
        finally:
            await resp.aclose()
        _check_end_stream(body_bytes, "process.Process/StreamInput")

    # ---- filesystem -------------------------------------------------------------------------

    async def stat(self, path: str, user: str | None = None) -> dict:
        """EntryInfo of ``path`` (raises EnvdError ``not_found`` if missing)."""
        return (await self.rpc("filesystem.Filesystem/Stat", {"path": path}, user))["entry"]

    async def list_dir(self, path: str, depth: int = 1, user: str | None = None) -> list[dict]:
        return (await self.rpc("filesystem.Filesystem/ListDir", {"path": path, "depth": depth}, user)).get(
            "entries", [])

    async def make_dir(self, path: str, user: str | None = None) -> bool:
        """``mkdir -p``; False if the directory already existed."""
        try:
            await self.rpc("filesystem.Filesystem/MakeDir", {"path": path}, user)
        except EnvdError as exc:
            if exc.code == "already_exists":
                return False
            raise
        return True

    async def move(self, source: str, destination: str, user: str | None = None) -> dict:
        return (await self.rpc("filesystem.Filesystem/Move",
                               {"source": source, "destination": destination}, user))["entry"]

    async def remove(self, path: str, user: str | None = None) -> None:
        """Recursive remove; a missing path is not an error."""
        await self.rpc("filesystem.Filesystem/Remove", {"path": path}, user)

    async def watch_dir(self, path: str, recursive: bool = False, user: str | None = None,
                        timeout: float | None = None, include_entry: bool = False) -> AsyncIterator[dict]:
        """``filesystem.Filesystem/WatchDir``: yield ``FilesystemEvent`` dicts (``{"name": "a.txt",
        "type": "EVENT_TYPE_CREATE", "entry"?: {...}}``) as they happen; names are relative to
        ``path``. The first yield comes once the watch is in place. ``timeout`` ends the watch
        with ``EnvdError("deadline_exceeded")``."""
        message = {"path": path, "recursive": recursive, "includeEntry": include_entry}
        first = True
        async with aclosing(self._server_stream("filesystem.Filesystem/WatchDir", message, user, timeout)) as payloads:
            async for payload in payloads:
                if "start" in payload and first:
                    first = False
                    yield {"start": True}
                elif "filesystem" in payload:
                    yield payload["filesystem"]

    async def create_watcher(self, path: str, recursive: bool = False, user: str | None = None) -> str:
        """A polling watcher (``CreateWatcher``); returns its id for :meth:`watcher_events`."""
        return (await self.rpc("filesystem.Filesystem/CreateWatcher",
                               {"path": path, "recursive": recursive}, user))["watcherId"]

    async def watcher_events(self, watcher_id: str) -> list[dict]:
        """Events since the last call (``GetWatcherEvents``)."""
        return (await self.rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher_id})).get(
            "events", [])

    async def remove_watcher(self, watcher_id: str) -> None:
        await self.rpc("filesystem.Filesystem/RemoveWatcher", {"watcherId": watcher_id})

    async def metrics(self) -> dict:
        """``GET /metrics``: ``ts``, ``cpu_count``, ``cpu_used_pct``, ``mem_*`` and ``disk_*`` (bytes)."""
        resp = await self._request("GET", "/metrics", headers=self._headers())
        if resp.status_code != 200:
            raise _error_from_body(resp.status_code, resp.content)
        return resp.json()

    async def forward_port(self, port: int) -> bool:
        """``POST /port-forward``: make a service that listens only on the guest's loopback at
        ``port`` reachable on the address this client dials; False if nothing listens there."""
        resp = await self._request("POST", "/port-forward", params={"port": str(port)}, headers=self._headers())
        if resp.status_code != 200:
            raise _error_from_body(resp.status_code, resp.content)
        return bool(resp.json().get("forwarding"))

    def _file_params(self, path: str, user: str | None) -> dict[str, str]:
        return {"path": path, **({"username": user} if user else {})}

    async def read_file(self, path: str, user: str | None = None) -> bytes:
        """The whole file, in memory and unbounded (small files; :meth:`download` streams)."""
        # identity: the agent gzips when asked (as envd does), which only costs guest CPU here.
        resp = await self._request("GET", "/files", params=self._file_params(path, user), limit=None,
                                   headers=self._headers(**{"Accept-Encoding": "identity"}))
        if resp.status_code != 200:
            raise _error_from_body(resp.status_code, resp.content)
        return resp.content

    async def download(self, path: str, user: str | None = None) -> AsyncIterator[bytes]:
        """Stream a file's content in chunks without holding it in memory."""
        request = self._http.build_request("GET", "/files", params=self._file_params(path, user),
                                           headers=self._headers(**{"Accept-Encoding": "identity"}))
        resp = await self._send_stream(request, "GET /files")
        try:
            with _transport_errors("GET /files"):
                async for chunk in resp.aiter_bytes():
                    yield chunk
        finally:
            await resp.aclose()

    async def write_file(self, path: str, data: bytes | AsyncIterator[bytes], user: str | None = None) -> None:
        """Write (create or replace) a file; an async iterator is streamed with chunked encoding.
        Parent directories are created. A full disk raises EnvdError ``resource_exhausted``."""
        resp = await self._request("POST", "/files", params=self._file_params(path, user), content=data,
                                   headers=self._headers(**{"Content-Type": "application/octet-stream"}))
        if resp.status_code != 200:
            raise _error_from_body(resp.status_code, resp.content)
