"""Fixtures for CLI tests that need no real server and start no VM.

``stub`` is a tiny threaded HTTP server speaking just enough of the AgentENV API (canned
answers per route, every request recorded), so the client side of each command — request
shapes, streaming, error lines, exit codes — is tested for real over HTTP.
"""

from __future__ import annotations

import json
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


Route = Callable[[Recorded], Answer]


@dataclass
class Stub:
    url: str
    routes: dict[tuple[str, str], Answer | Route] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)

    def on(self, method: str, path: str, answer: Answer | Route | Any, status: int = 200) -> None:
        """Register an answer; plain data is sent as JSON with ``status``."""
        if not isinstance(answer, Answer) and not callable(answer):
            answer = Answer(status, json.dumps(answer).encode())
        self.routes[(method, path)] = answer

    def calls(self, method: str, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path == path]


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
            if route is None:
                answer = Answer(404, json.dumps({"code": 404, "message": f"no route {parts.path}"}).encode())
            else:
                answer = route(rec) if callable(route) else route
            chunks = answer.body if isinstance(answer.body, list) else [answer.body]
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            self.send_header("Content-Length", str(sum(len(c) for c in chunks)))
            self.end_headers()
            for c in chunks:
                self.wfile.write(c)
                self.wfile.flush()

        do_GET = do_POST = do_PUT = do_DELETE = _serve

    return Handler


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(Stub("")))
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
        monkeypatch.delenv(name, raising=False)
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
