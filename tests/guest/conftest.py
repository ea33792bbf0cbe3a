"""Fixtures that run the real guest agent as a subprocess on 127.0.0.1.

The agent is started as in the guest (``python3 agent.py --host ... --port ... --tools DIR``, the
tools dir holding only the spawn library, built here) but with test-only environment variables:
``AENV_AGENT_RUN_DIR`` redirects the /run/e2b marker files into a temporary directory,
``AENV_AGENT_NO_CLOCK=1`` stops /init from setting the host clock and ``AENV_AGENT_STATE`` moves
the file /init's state is kept in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from agentenv.bench.node import free_port
from agentenv.envd_client import EnvdClient
from agentenv.images.toolsdrive import SPAWN_LIBRARY, build_spawn_library

AGENT = Path(__file__).resolve().parents[2] / "src" / "agentenv" / "guest" / "agent.py"
SPAWN_C = AGENT.parent / "spawn.c"


@pytest.fixture(scope="session")
def tools_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tools dir with the library every command starts through (lib/libaenvspawn.so, built
    as images/toolsdrive.py builds it for the tools drive)."""
    d = tmp_path_factory.mktemp("tools")
    (d / "lib").mkdir()
    build_spawn_library(SPAWN_C, d / "lib" / SPAWN_LIBRARY)
    return d


@dataclass
class RunningAgent:
    url: str
    pid: int
    run_dir: Path
    log: Path


@pytest.fixture
def agent(tmp_path: Path, tools_dir: Path) -> Iterator[RunningAgent]:
    port = free_port()
    run_dir = tmp_path / "run-e2b"
    log = tmp_path / "agent.log"
    env = {**os.environ, "AENV_AGENT_RUN_DIR": str(run_dir), "AENV_AGENT_NO_CLOCK": "1",
           "AENV_AGENT_STATE": str(tmp_path / "agent-state.json"), "AENV_AGENT_HEAD_TIMEOUT": "3"}
    with open(log, "wb") as log_file:
        # The guest runs Debian's system python3; use the same kind of interpreter, not the venv.
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        proc = subprocess.Popen([python, str(AGENT), "--host", "127.0.0.1", "--port", str(port),
                                 "--tools", str(tools_dir)],
                                env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 204:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"agent did not start:\n{log.read_text()}")
        time.sleep(0.05)
    yield RunningAgent(url, proc.pid, run_dir, log)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
async def client(agent: RunningAgent) -> AsyncIterator[EnvdClient]:
    c = EnvdClient(agent.url, timeout=30.0)
    yield c
    await c.aclose()


@pytest.fixture
async def http(agent: RunningAgent) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=agent.url, timeout=30.0) as c:
        yield c
