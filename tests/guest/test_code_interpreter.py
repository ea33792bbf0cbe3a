"""The in-sandbox code-interpreter server (port 49999) against the real ``e2b-code-interpreter`` SDK.

The server runs on the host as a subprocess on a free loopback port, exactly as in the guest
(``python3 server.py --port N``, standard library only). The SDK runs, unchanged, in its own
virtualenv (``scripts/sdk-clients``, ``ci-<version>``) in a subprocess pointed at the bare server
the way E2B's own SDK allows it: ``E2B_DEBUG=true`` makes ``Sandbox.create()`` skip the control
plane, and ``E2B_SANDBOX_URL`` makes every sandbox URL -- including the one for port 49999 that
``run_code`` uses -- the server's address. A fake envd on another port serves ``GET /envs`` so the
sandbox-wide env vars are exercised too.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx
import pytest

from agentenv.bench.node import free_port
from tests.framework.sdk import LAUNCHER, SDK_CACHE

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "src" / "agentenv" / "guest" / "code_interpreter" / "server.py"
CI_VERSION = "2.11.5"



class _FakeEnvd(http.server.BaseHTTPRequestHandler):
    tokens: ClassVar[list[str | None]] = []
    required: ClassVar[str | None] = None  # the access token it accepts, as envd once given one

    def do_GET(self) -> None:
        _FakeEnvd.tokens.append(self.headers.get("X-Access-Token"))
        if _FakeEnvd.required is not None and self.headers.get("X-Access-Token") != _FakeEnvd.required:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"SANDBOX_WIDE": "from-envd"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def fake_envd() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeEnvd)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@dataclass
class CIServer:
    url: str
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def ci_server(tmp_path_factory: pytest.TempPathFactory, fake_envd: str) -> Iterator[CIServer]:
    tmp = tmp_path_factory.mktemp("ci")
    port = free_port()
    log = tmp / "server.log"
    env = {**os.environ, "AENV_CI_ENVD_URL": fake_envd}
    with open(log, "wb") as log_file:
        # The guest runs Debian's system python3 with nothing installed; use a plain interpreter.
        proc = subprocess.Popen(["python3", str(SERVER), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log_file, stderr=log_file, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    yield CIServer(url, proc, log)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def sdk_python() -> Path:
    env = {**os.environ, "AENV_SDK_CACHE": str(SDK_CACHE), "AENV_E2B_PY_VERSIONS": "", "AENV_E2B_CI_VERSIONS": CI_VERSION}
    env.setdefault("AENV_PYTHON", sys.executable if sys.version_info >= (3, 11) else "python3")
    # Install only the code-interpreter SDK (the JS SDK is cached by the E2B tests' run).
    r = subprocess.run([str(ROOT / "scripts" / "sdk-clients")], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return SDK_CACHE / f"ci-{CI_VERSION}" / "bin" / "python"


@pytest.fixture
def run_sdk(ci_server: CIServer, sdk_python: Path, tmp_path: Path):
    """Run an SDK program against the server; its last JSON line of stdout is returned."""

    def run(program: str, timeout: float = 120) -> dict:
        prog = tmp_path / "prog.py"
        prog.write_text("import json\nfrom e2b_code_interpreter import Sandbox\nsbx = Sandbox.create()\n"
                        + textwrap.dedent(program))
        launcher = tmp_path / "launch.py"
        launcher.write_text(LAUNCHER)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(E2B_DEBUG="true", E2B_SANDBOX_URL=ci_server.url, E2B_API_KEY="unused")
        r = subprocess.run([str(sdk_python), str(launcher), str(prog)], env=env, capture_output=True, text=True,
                           timeout=timeout, check=False)
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert lines, f"no JSON result\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
        return json.loads(lines[-1])  # type: ignore[no-any-return]

    return run


def test_state_persists_and_execution_count_increments(run_sdk) -> None:
    out = run_sdk("""
        ctx = sbx.create_code_context()
        a = sbx.run_code("x = 1", context=ctx)
        b = sbx.run_code("x + 1", context=ctx)
        c = sbx.run_code("None", context=ctx)
        print(json.dumps({"a_results": len(a.results), "text": b.results[0].text, "main": b.results[0].is_main_result,
                          "counts": [a.execution_count, b.execution_count, c.execution_count],
                          "none_results": len(c.results), "error": b.error is None}))
    """)
    assert out == {"a_results": 0, "text": "2", "main": True, "counts": [1, 2, 3], "none_results": 0, "error": True}


def test_stdout_streams_incrementally_in_order(run_sdk) -> None:
    out = run_sdk("""
        import time
        seen = []
        t0 = time.monotonic()
        ex = sbx.run_code(
            "import time, sys\\nfor i in range(4):\\n    print(f'line {i}')\\n    time.sleep(0.4)\\n"
            "print('oops', file=sys.stderr)",
            on_stdout=lambda m: seen.append((m.line, time.monotonic() - t0, m.timestamp)),
            on_stderr=lambda m: seen.append((m.line, time.monotonic() - t0, m.timestamp)))
        print(json.dumps({"seen": seen, "stdout": ex.logs.stdout, "stderr": ex.logs.stderr}))
    """)
    lines = [s[0] for s in out["seen"]]
    assert lines == ["line 0\n", "line 1\n", "line 2\n", "line 3\n", "oops\n"]
    assert out["stdout"] == lines[:4] and out["stderr"] == ["oops\n"]
    arrivals = [s[1] for s in out["seen"]]
    # Streamed as produced: the first line arrives long before the last one was printed.
    assert arrivals[3] - arrivals[0] > 0.9, arrivals
    assert all("T" in s[2] for s in out["seen"])  # ISO 8601 timestamps


def test_error_has_name_value_and_user_traceback(run_sdk) -> None:
    out = run_sdk("""
        ex = sbx.run_code("def f():\\n    return 1 / 0\\nf()")
        syn = sbx.run_code("1 +")
        after = sbx.run_code("21 * 2")
        print(json.dumps({"name": ex.error.name, "value": ex.error.value, "tb": ex.error.traceback,
                          "syn": syn.error.name, "after": after.results[0].text}))
    """)
    assert out["name"] == "ZeroDivisionError" and out["value"] == "division by zero"
    assert "return 1 / 0" in out["tb"] and "in f" in out["tb"] and out["tb"].endswith("ZeroDivisionError: division by zero")
    assert "kernel.py" not in out["tb"]  # user frames only
    assert out["syn"] == "SyntaxError" and out["after"] == "42"


def test_contexts_create_list_restart_remove_and_cwd(run_sdk, tmp_path: Path) -> None:
    out = run_sdk(f"""
        ctx = sbx.create_code_context(cwd={str(tmp_path)!r})
        other = sbx.create_code_context()
        sbx.run_code("y = 5", context=ctx)
        cwd = sbx.run_code("import os; os.getcwd()", context=ctx).results[0].text
        isolated = sbx.run_code("y", context=other).error.name
        before = sbx.run_code("y", context=ctx).results[0].text
        listed = [c.id for c in sbx.list_code_contexts()]
        sbx.restart_code_context(ctx)
        gone = sbx.run_code("y", context=ctx).error.name
        cwd_after = sbx.run_code("import os; os.getcwd()", context=ctx).results[0].text
        sbx.remove_code_context(ctx)
        sbx.remove_code_context(other.id)
        listed_after = [c.id for c in sbx.list_code_contexts()]
        try:
            sbx.run_code("1", context=ctx)
            missing = None
        except Exception as exc:
            missing = type(exc).__name__ + ": " + str(exc)
        print(json.dumps({{"ctx": ctx.id, "other": other.id, "cwd": cwd, "ctx_cwd": ctx.cwd, "lang": ctx.language,
                          "isolated": isolated, "before": before, "listed": listed, "gone": gone,
                          "cwd_after": cwd_after, "listed_after": listed_after, "missing": missing}}))
    """)
    assert out["cwd"] == repr(str(tmp_path)) == out["cwd_after"] and out["ctx_cwd"] == str(tmp_path)
    assert out["lang"] == "python"
    assert out["isolated"] == "NameError" and out["before"] == "5" and out["gone"] == "NameError"
    assert {out["ctx"], out["other"]} <= set(out["listed"])
    assert out["ctx"] not in out["listed_after"] and out["other"] not in out["listed_after"]
    assert out["missing"].startswith("NotFoundException") and out["ctx"] in out["missing"]


def test_env_vars_per_run_and_sandbox_wide(run_sdk) -> None:
    out = run_sdk("""
        during = sbx.run_code("import os; os.environ['MY_VAR']", envs={"MY_VAR": "hello"}).results[0].text
        after = sbx.run_code("import os; repr(os.environ.get('MY_VAR'))").results[0].text
        wide = sbx.run_code("import os; os.environ.get('SANDBOX_WIDE')").results[0].text
        override = sbx.run_code("import os; os.environ['SANDBOX_WIDE']", envs={"SANDBOX_WIDE": "mine"}).results[0].text
        print(json.dumps({"during": during, "after": after, "wide": wide, "override": override}))
    """)
    assert out == {"during": "'hello'", "after": "'None'", "wide": "'from-envd'", "override": "'mine'"}


CELL_WITH_DISPLAY = """\
class Table:
    def _repr_html_(self):
        return "<table><tr><td>1</td></tr></table>"
    def _repr_markdown_(self):
        return "| 1 |"
    def __repr__(self):
        return "Table()"

class Pic:
    def _repr_png_(self):
        return b"\\x89PNG fake"

print("before")
display(Table())
print("after")
Pic()
"""


def test_display_and_rich_results(run_sdk) -> None:
    out = run_sdk(f"""
        seen = []
        ex = sbx.run_code({CELL_WITH_DISPLAY!r}, on_result=lambda r: seen.append("result"),
                          on_stdout=lambda m: seen.append(m.line))
        d, m = ex.results
        print(json.dumps({{"seen": seen, "d": [d.is_main_result, d.html, d.markdown, d.text],
                          "m": [m.is_main_result, m.png, m.text is not None]}}))
    """)
    assert out["seen"] == ["before\n", "result", "after\n", "result"]
    assert out["d"] == [False, "<table><tr><td>1</td></tr></table>", "| 1 |", "Table()"]
    assert out["m"][0] is True and out["m"][2] is True
    assert base64.b64decode(out["m"][1]) == b"\x89PNG fake"


def test_client_timeout_interrupts_and_next_run_works(run_sdk, ci_server: CIServer) -> None:
    out = run_sdk("""
        import time
        ctx = sbx.create_code_context()
        sbx.run_code("state = 7", context=ctx)
        t0 = time.monotonic()
        try:
            sbx.run_code("import time\\ntime.sleep(30)", context=ctx, timeout=1)
            timed_out = None
        except Exception as exc:
            timed_out = type(exc).__name__ + ": " + str(exc)
        ex = sbx.run_code("state + 1", context=ctx)
        took = time.monotonic() - t0
        print(json.dumps({"timed_out": timed_out, "text": ex.results[0].text, "took": took}))
    """)
    assert out["timed_out"].startswith("TimeoutException") and "timed out" in out["timed_out"]
    assert out["text"] == "8"  # interrupted, not restarted: the state survives
    assert out["took"] < 10
    assert "interrupting the kernel" in ci_server.log.read_text()


def test_plain_http_contract(ci_server: CIServer, fake_envd: str) -> None:
    with httpx.Client(base_url=ci_server.url, timeout=30) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json() == "OK"
        r = c.post("/execute", json={"code": "1", "context_id": "x", "language": "python"})
        assert r.status_code == 400
        r = c.post("/execute", json={"code": "1", "context_id": "no-such-context"})
        assert r.status_code == 404 and "no-such-context" in r.text
        r = c.post("/execute", json={"code": "1", "language": "javascript"})
        assert r.status_code == 400 and "python" in r.text
        assert c.post("/contexts", json={"language": "r"}).status_code == 400
        assert c.post("/contexts", json={"cwd": "/no/such/dir"}).status_code == 400
        assert c.post("/contexts/nope/restart").status_code == 404
        assert c.delete("/contexts/nope").status_code == 404
        assert c.get("/nope").status_code == 404

        default = [ctx for ctx in c.get("/contexts").json() if ctx["cwd"] in ("/home/user", "/")]
        assert default and default[0]["language"] == "python"  # created at start-up

        _FakeEnvd.tokens.clear()
        with c.stream("POST", "/execute", json={"code": "print('hi')\n3", "language": "python"},
                      headers={"X-Access-Token": "tok-123"}) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-ndjson"
            lines = [json.loads(ln) for ln in resp.iter_lines() if ln]
        assert [ln["type"] for ln in lines] == ["number_of_executions", "stdout", "result", "end_of_execution"]
        assert lines[2] == {"type": "result", "is_main_result": True, "text": "3"}
        assert _FakeEnvd.tokens == ["tok-123"]


def test_keepalive_lines_while_silent(ci_server: CIServer) -> None:
    with httpx.Client(base_url=ci_server.url, timeout=30) as c, \
            c.stream("POST", "/execute", json={"code": "import time\ntime.sleep(5.5)\n'done'"}) as resp:
        types = [json.loads(ln)["type"] for ln in resp.iter_lines() if ln]
    assert types == ["number_of_executions", "keepalive", "result", "end_of_execution"]


def test_kernel_death_is_reported_and_recovered(ci_server: CIServer) -> None:
    with httpx.Client(base_url=ci_server.url, timeout=30) as c:
        ctx = c.post("/contexts", json={}).json()
        lines = [json.loads(ln) for ln in c.post("/execute", json={"code": "import os\nos._exit(3)",
                                                                   "context_id": ctx["id"]}).text.splitlines()]
        assert [ln["type"] for ln in lines] == ["number_of_executions", "error", "end_of_execution"]
        assert lines[1]["name"] == "KernelDied"
        lines = [json.loads(ln) for ln in c.post("/execute", json={"code": "40 + 2", "context_id": ctx["id"]}).text.splitlines()]
        assert {"type": "result", "is_main_result": True, "text": "42"} in lines
        assert c.delete(f"/contexts/{ctx['id']}").status_code == 200


def test_running_code_needs_the_sandboxs_access_token(ci_server: CIServer) -> None:
    """The proxy lets anyone who knows a sandbox's id reach port 49999: code runs only for a
    caller with the sandbox's envd access token (envd, which handed it out, judges it)."""
    _FakeEnvd.required = "tok"
    try:
        for headers in ({}, {"X-Access-Token": "wrong"}):
            r = httpx.post(f"{ci_server.url}/execute", json={"code": "1+1"}, headers=headers, timeout=30)
            assert r.status_code == 401 and "access token" in r.text, r.text
        r = httpx.post(f"{ci_server.url}/execute", json={"code": "1+1"}, headers={"X-Access-Token": "tok"}, timeout=30)
        results = [json.loads(ln) for ln in r.text.splitlines() if ln.strip()]
        assert r.status_code == 200 and any(x.get("text") == "2" for x in results), r.text
    finally:
        _FakeEnvd.required = None
