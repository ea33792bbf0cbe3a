"""Fixtures for CLI tests that need no real server and start no VM.

``stub`` is a tiny threaded HTTP server speaking just enough of the AgentENV API (canned
answers per route, every request recorded), so the client side of each command — request
shapes, streaming, error lines, exit codes — is tested for real over HTTP.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from agentenv.cli.main import app

AENV_VARS = ("AENV_URL", "AENV_API_KEY", "AENV_DATA_DIR", "AENV_CACHE_DIR", "AENV_HOST", "AENV_PORT",
             "AENV_ACCEL", "AENV_MEM_DIR")


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-response (the CLI's streaming shell on exit) is normal here;
    socketserver would print its traceback to stderr, which the CLI tests capture and read."""

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Answer:
    status: int = 200
    body: bytes | list[bytes] = b""  # a list is sent as separate writes (streamed)
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


Route = Callable[[Recorded], Answer]


@dataclass
class Stub:
    url: str
    routes: dict[tuple[str, str], Answer | Route] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    # Asked when no route in ``routes`` matches; None from it means "no route" (404).
    fallback: Callable[[Recorded], Answer | None] | None = None

    def on(self, method: str, path: str, answer: Answer | Route | Any, status: int = 200) -> None:
        """Register an answer; plain data is sent as JSON with ``status``."""
        if not isinstance(answer, Answer) and not callable(answer):
            answer = Answer(status, json.dumps(answer).encode())
        self.routes[(method, path)] = answer

    def calls(self, method: str, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path == path]


def error(status: int, message: str) -> Answer:
    return Answer(status, json.dumps({"code": status, "message": message}).encode())


def _handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    out += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return bytes(out)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _serve(self) -> None:
            parts = urlsplit(self.path)
            rec = Recorded(self.command, parts.path, parse_qs(parts.query), dict(self.headers), self._body())
            stub.requests.append(rec)
            route = stub.routes.get((self.command, parts.path))
            if route is not None:
                answer = route(rec) if callable(route) else route
            else:
                answer = (stub.fallback(rec) if stub.fallback else None) or error(404, f"no route {parts.path}")
            chunks = answer.body if isinstance(answer.body, list) else [answer.body]
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(sum(len(c) for c in chunks)))
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.end_headers()
            for c in chunks:
                self.wfile.write(c)
                self.wfile.flush()

        do_GET = do_POST = do_PUT = do_DELETE = _serve

    return Handler


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = _QuietServer(("127.0.0.1", 0), _handler(Stub("")))
    s = Stub(f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = _handler(s)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield s
    server.shutdown()
    server.server_close()


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME and no AENV_* variables; restored afterwards even if a command sets them."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in AENV_VARS:
        # setenv first: it records the variable's original state, so a value a command writes
        # (`aenv setup --cache-dir` sets AENV_CACHE_DIR in os.environ) is undone at teardown
        # too; a bare delenv of an unset variable records nothing, and the value leaked into
        # every later test (the bench run by tests/e2e/test_bench.py then used a fake cache).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("AENV_DATA_DIR", str(tmp_path / "data"))  # never the real /var/lib/agentenv
    return home


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def aenv(runner: CliRunner) -> Callable[..., Any]:
    """``aenv(*args, input=None)`` → click Result (stdout/stderr apart, exit_code)."""

    def invoke(*args: str, input: str | None = None) -> Any:
        return runner.invoke(app, list(args), input=input)

    return invoke


class SavedStatesApi:
    """The sandbox and saved-state routes of the server, kept in memory; installed as ``stub.fallback``.

    Same paths, status codes and error bodies as ``agentenv.api.routes``: pause 204 (409 unless
    running), resume 201 (409 unless paused), connect 200 (running) / 201 (resumed), snapshots
    201 / list / delete 204, fork 201 with one item per child, ``POST /sandboxes`` from a
    template or a snapshot; unknown sandboxes and snapshots are 404.
    """

    STARTED = "2030-01-01T00:00:00Z"

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.snapshots: list[dict[str, Any]] = []
        self.templates = {"base"}
        self.failing_children: dict[int, tuple[int, str]] = {}  # fork child index → (code, message)
        self._n = 0
        self.routes: list[tuple[str, re.Pattern[str], Callable[..., Answer]]] = [
            ("GET", re.compile(r"/sandboxes"), self.list_sandboxes),
            ("POST", re.compile(r"/sandboxes"), self.create),
            ("DELETE", re.compile(r"/sandboxes/([^/]+)"), self.kill),
            ("POST", re.compile(r"/sandboxes/([^/]+)/pause"), self.pause),
            ("POST", re.compile(r"/sandboxes/([^/]+)/resume"), self.resume),
            ("POST", re.compile(r"/sandboxes/([^/]+)/connect"), self.connect),
            ("POST", re.compile(r"/sandboxes/([^/]+)/snapshots"), self.snapshot),
            ("POST", re.compile(r"/sandboxes/([^/]+)/fork"), self.fork),
            ("GET", re.compile(r"/snapshots"), self.list_snapshots),
            ("DELETE", re.compile(r"/snapshots/([^/]+)"), self.delete_snapshot),
        ]

    def __call__(self, rec: Recorded) -> Answer | None:
        for method, pattern, handler in self.routes:
            if method == rec.method and (m := pattern.fullmatch(rec.path)):
                return handler(rec, *m.groups())
        return None

    # --- helpers --------------------------------------------------------------------------------

    def add(self, template: str = "base", state: str = "running", sandbox_id: str | None = None) -> str:
        self._n += 1
        sid = sandbox_id or f"sb{self._n}"
        self.sandboxes[sid] = {"templateID": template, "sandboxID": sid, "alias": template,
                               "startedAt": self.STARTED, "endAt": "2030-01-01T00:05:00Z", "cpuCount": 2,
                               "memoryMB": 512, "diskSizeMB": 4096, "state": state, "metadata": {},
                               "error": None}
        return sid

    @staticmethod
    def _json(status: int, data: Any) -> Answer:
        return Answer(status, json.dumps(data).encode())

    @staticmethod
    def _body(rec: Recorded) -> dict[str, Any]:
        return rec.json() if rec.body.strip() else {}

    def _sandbox(self, sid: str) -> dict[str, Any]:
        s = self.sandboxes[sid]
        return {"templateID": s["templateID"], "sandboxID": sid, "clientID": "", "envdVersion": "0.2.0",
                "envdAccessToken": f"tok-{sid}", "alias": s["templateID"]}

    def _needs(self, sid: str, state: str) -> Answer | None:
        if sid not in self.sandboxes:
            return error(404, f"sandbox '{sid}' not found")
        if (now := self.sandboxes[sid]["state"]) != state:
            return error(409, f"sandbox '{sid}' is {now}; this operation needs it {state}")
        return None

    def _find_snapshot(self, id_or_name: str) -> dict[str, Any] | None:
        return next((s for s in self.snapshots if id_or_name == s["snapshotID"] or id_or_name in s["names"]), None)

    # --- routes ---------------------------------------------------------------------------------

    def list_sandboxes(self, rec: Recorded) -> Answer:
        wanted = set(",".join(rec.query.get("state", [])).split(",")) - {""}
        return self._json(200, [s for s in self.sandboxes.values() if not wanted or s["state"] in wanted])

    def create(self, rec: Recorded) -> Answer:
        template = self._body(rec).get("templateID", "base")
        snap = self._find_snapshot(template)
        if template not in self.templates and snap is None:
            return error(404, f"template '{template}' not found; `aenv template ls` lists the available templates")
        sid = self.add((snap["names"] or [snap["snapshotID"]])[0] if snap else template)
        return self._json(201, self._sandbox(sid))

    def kill(self, rec: Recorded, sid: str) -> Answer:
        if self.sandboxes.pop(sid, None) is None:
            return error(404, f"sandbox '{sid}' not found")
        return Answer(204)

    def pause(self, rec: Recorded, sid: str) -> Answer:
        if problem := self._needs(sid, "running"):
            return problem
        self.sandboxes[sid]["state"] = "paused"
        return Answer(204)

    def resume(self, rec: Recorded, sid: str) -> Answer:
        if problem := self._needs(sid, "paused"):
            return problem
        self.sandboxes[sid]["state"] = "running"
        return self._json(201, self._sandbox(sid))

    def connect(self, rec: Recorded, sid: str) -> Answer:
        if sid in self.sandboxes and self.sandboxes[sid]["state"] == "running":
            return self._json(200, self._sandbox(sid))
        return self.resume(rec, sid)

    def snapshot(self, rec: Recorded, sid: str) -> Answer:
        if problem := self._needs(sid, "running"):
            return problem
        name = self._body(rec).get("name")
        if name is not None and (name in self.templates or self._find_snapshot(name)):
            return error(400, f"the name '{name}' is already used by a template or snapshot; choose another one")
        self._n += 1
        s = self.sandboxes[sid]
        snap = {"snapshotID": f"snap-{self._n:04d}", "names": [name] if name else [], "sandboxID": sid,
                "templateID": s["templateID"], "createdAt": 1893456000.0 + self._n, "cpuCount": s["cpuCount"],
                "memoryMB": s["memoryMB"]}
        self.snapshots.append(snap)
        return self._json(201, snap)

    def list_snapshots(self, rec: Recorded) -> Answer:
        sid, name = (rec.query.get(k, [None])[0] for k in ("sandboxID", "name"))
        return self._json(200, [s for s in self.snapshots
                                if (sid is None or s["sandboxID"] == sid) and (name is None or name in s["names"])])

    def delete_snapshot(self, rec: Recorded, id_or_name: str) -> Answer:
        snap = self._find_snapshot(id_or_name)
        if snap is None:
            return error(404, f"snapshot '{id_or_name}' not found; `aenv snapshot ls` lists the snapshots")
        self.snapshots.remove(snap)
        return Answer(204)

    def fork(self, rec: Recorded, sid: str) -> Answer:
        count = self._body(rec).get("count", 1)
        if not 1 <= count <= 20:
            return error(400, f"count must be between 1 and 20, got {count}")
        if problem := self._needs(sid, "running"):
            return problem
        items: list[dict[str, Any]] = []
        for i in range(count):
            if i in self.failing_children:
                code, message = self.failing_children[i]
                items.append({"error": {"code": code, "message": message}})
            else:
                items.append({"sandbox": self._sandbox(self.add(self.sandboxes[sid]["templateID"]))})
        return self._json(201, items)


@pytest.fixture
def states(stub: Stub) -> SavedStatesApi:
    """An in-memory server behind ``stub`` for sandboxes, pause/resume, snapshots and fork."""
    api = SavedStatesApi()
    stub.fallback = api
    return api
