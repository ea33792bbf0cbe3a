"""The code-interpreter template, built by the project's own template build (the build file in
src/agentenv/guest/code_interpreter/), driven by the real `e2b-code-interpreter` SDK."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2b.conftest import SDK
from tests.framework.server import ServerProcess

CI_VERSION = "2.11.5"  # scripts/sdk-clients installs it (AENV_E2B_CI_VERSIONS)
SOURCE = Path(__file__).resolve().parents[2] / "src" / "agentenv" / "guest" / "code_interpreter"
TEMPLATE = "code-interpreter-v1"  # the SDK's default template


@pytest.fixture(scope="module")
def code_interpreter(e2b_server: ServerProcess, api: httpx.Client) -> Iterator[str]:
    env = {**os.environ, "AENV_URL": e2b_server.url, "AENV_API_KEY": e2b_server.api_key}
    r = subprocess.run([sys.executable, "-m", "agentenv.cli.main", "template", "build", "--name", TEMPLATE,
                        "-f", str(SOURCE / "aenv.Dockerfile"), str(SOURCE)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    yield TEMPLATE
    api.delete(f"/templates/{TEMPLATE}")


def _run(sdk: SDK, program: str) -> dict:
    return sdk.python(CI_VERSION, program, timeout=600, venv="ci")


def test_run_code_with_results_streams_errors_and_contexts(sdk: SDK, code_interpreter: str) -> None:
    out = _run(sdk, """
        import json
        from e2b_code_interpreter import Sandbox

        sb = Sandbox.create(timeout=300)  # the default template: code-interpreter-v1
        try:
            sb.run_code("x = 41")
            main = sb.run_code("x + 1")
            lines = []
            sb.run_code("for i in range(3): print('line', i)", on_stdout=lambda m: lines.append(str(m.line if hasattr(m, 'line') else m)))
            err = sb.run_code("1/0")
            html = sb.run_code("class H:\\n    def _repr_html_(self): return '<b>hi</b>'\\nH()")
            ctx = sb.create_code_context(cwd="/tmp")
            cwd = sb.run_code("import os; os.getcwd()", context=ctx)
            contexts = [c.id for c in sb.list_code_contexts()]
            env = sb.run_code("import os; os.environ.get('MY_VAR')", envs={"MY_VAR": "set"})
            after = sb.run_code("import os; os.environ.get('MY_VAR')")
            who = sb.commands.run("whoami").stdout.strip()
            print(json.dumps({
                "main": main.text, "count": main.execution_count, "lines": lines,
                "err": [err.error.name, err.error.value, "ZeroDivisionError" in err.error.traceback],
                "html": html.results[0].html if html.results else None, "cwd": cwd.text,
                "ctx_listed": ctx.id in contexts, "env": env.text, "after": after.text, "who": who,
            }))
        finally:
            sb.kill()
    """)
    assert out["main"] == "42" and out["count"] == 2
    assert [ln.strip() for ln in out["lines"]] == ["line 0", "line 1", "line 2"]
    assert out["err"] == ["ZeroDivisionError", "division by zero", True]
    assert out["html"] == "<b>hi</b>"
    assert out["cwd"] == "'/tmp'" and out["ctx_listed"]
    assert out["env"] == "'set'" and out["after"] is None
    assert out["who"] == "user"  # SDK commands run as the default user; the kernels as root


def test_server_restarts_after_being_killed(sdk: SDK, code_interpreter: str) -> None:
    out = _run(sdk, """
        import json, time
        from e2b_code_interpreter import Sandbox

        sb = Sandbox.create(timeout=300)
        try:
            before = sb.run_code("1 + 1").text
            sb.commands.run("sudo pkill -9 -f 'code-interpreter/serve[r].py'")  # [r]: not this shell
            after, deadline = None, time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    after = sb.run_code("2 + 2", timeout=30).text
                    break
                except Exception:
                    time.sleep(1)
            print(json.dumps({"before": before, "after": after}))
        finally:
            sb.kill()
    """)
    assert out == {"before": "2", "after": "4"}
