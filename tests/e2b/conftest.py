"""The official E2B SDKs, unchanged, against a real AgentENV server booting real microVMs.

Each SDK version lives in its own virtualenv (or npm project) installed by ``scripts/sdk-clients``
under ``$AENV_SDK_CACHE``; test programs run in it as subprocesses with the environment an E2B
user sets to point the SDK at a self-hosted server: ``E2B_API_URL`` (control plane),
``E2B_SANDBOX_URL`` (envd traffic, routed by the server's proxy on the E2b-Sandbox-* headers),
``E2B_API_KEY`` and ``E2B_DOMAIN``. Each program prints one JSON line of observations last;
the test asserts on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentenv.config import Settings
from agentenv.network import remove_slots_in
from tests.framework.net import node_cidr
from tests.framework.sdk import LAUNCHER, SDK_CACHE
from tests.framework.server import ServerProcess, all_sandboxes

ROOT = Path(__file__).resolve().parents[2]
PY_LATEST, PY_245, PY_1X = "2.63.0", "2.45.1", "1.11.1"
JS_VERSION = "2.51.0"
DOMAIN = "aenv.test"


@pytest.fixture(scope="session")
def sdk_clients() -> Path:
    """Install (once; cached) the SDK versions the tests use."""
    env = {**os.environ, "AENV_SDK_CACHE": str(SDK_CACHE), "AENV_E2B_PY_VERSIONS": f"{PY_LATEST} {PY_245} {PY_1X}",
           "AENV_E2B_JS_VERSION": JS_VERSION}
    env.setdefault("AENV_PYTHON", sys.executable if sys.version_info >= (3, 11) else "python3")
    r = subprocess.run([str(ROOT / "scripts" / "sdk-clients")], env=env, capture_output=True, check=False, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return SDK_CACHE


def _remove_slots_in(cidr: str) -> None:
    """Remove stale namespaces and veths of this server's address block (left by an earlier
    run cut short while another test run kept the session sweep from running)."""
    remove_slots_in(cidr)


@pytest.fixture(scope="session")
def e2b_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cidr = node_cidr(24)
    _remove_slots_in(cidr)
    # Pauses park the stopped VM as by default (the test nodes' own default frees it at once),
    # so the SDK's pause/connect runs on both paths: here, and in tests/e2e.
    s = ServerProcess(tmp_path_factory.mktemp("e2bnode") / "data", cidr, AENV_DOMAIN=DOMAIN,
                      AENV_PAUSE_LINGER_S=str(Settings().pause_linger_s))
    s.start()
    yield s
    s.kill_all()
    _remove_slots_in(cidr)


@pytest.fixture(scope="session")
def api(e2b_server: ServerProcess) -> Iterator[httpx.Client]:
    with e2b_server.client() as c:
        yield c




@dataclass
class SDK:
    """Runs programs against ``server`` with one installed SDK."""

    server: ServerProcess
    cache: Path
    tmp: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(E2B_API_KEY=self.server.api_key, E2B_API_URL=self.server.url, E2B_SANDBOX_URL=self.server.url,
                   E2B_DOMAIN=DOMAIN, AENV_TEST_SERVER=self.server.url)
        return env

    def python(self, version: str, program: str, timeout: float = 300, wrap: tuple[str, ...] = (),
               venv: str = "py", **env: str) -> dict:
        """Run ``program`` in the venv ``<venv>-<version>`` (``py``: e2b, ``ci``: e2b-code-interpreter)."""
        path = self.tmp / f"prog_{abs(hash(program))}.py"
        path.write_text(textwrap.dedent(program))
        # under the launcher of tests/framework/sdk.py (leaves with os._exit once done)
        launcher = self.tmp / "launch.py"
        launcher.write_text(LAUNCHER)
        return self._run([*wrap, str(self.cache / f"{venv}-{version}" / "bin" / "python"), str(launcher), str(path)],
                         timeout, env)

    def node(self, program: str, timeout: float = 300, **env: str) -> dict:
        project = self.cache / f"js-{JS_VERSION}"
        path = project / f"prog_{os.getpid()}_{abs(hash(program))}.mjs"  # resolves `e2b` from the project
        path.write_text(textwrap.dedent(program))
        try:
            return self._run(["node", str(path)], timeout, env)
        finally:
            path.unlink()

    def _run(self, argv: list[str], timeout: float, env: dict[str, str]) -> dict:
        r = subprocess.run(argv, env={**self.env(), **env}, capture_output=True, check=False, text=True, timeout=timeout)
        assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]  # the last one is the result
        assert lines, f"no JSON result\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
        return json.loads(lines[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def sdk(e2b_server: ServerProcess, sdk_clients: Path, tmp_path_factory: pytest.TempPathFactory) -> SDK:
    return SDK(e2b_server, sdk_clients, tmp_path_factory.mktemp("programs"))


@pytest.fixture(autouse=True)
def _no_leftover_sandboxes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test kills what it creates (the machine is small); a leftover fails the test."""
    yield
    if not {"api", "sdk"} & set(request.fixturenames):
        return
    server: ServerProcess = request.getfixturevalue("e2b_server")
    with server.client() as api:
        left = all_sandboxes(api)
        for s in left:
            api.delete(f"/sandboxes/{s['sandboxID']}")
    assert left == [], f"sandboxes left running: {[s['sandboxID'] for s in left]}"
