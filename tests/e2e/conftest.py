"""Fixtures: real servers booting real microVMs (TCG here), one per configuration."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default node: SQLite store, warm pool of 1."""
    s = ServerProcess(tmp_path_factory.mktemp("node") / "data", node_cidr(0, 20))
    s.start()
    yield s
    s.kill_all()


@pytest.fixture(scope="session")
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
def sandbox(api: httpx.Client) -> Iterator[str]:
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 600})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    yield sid
    api.delete(f"/sandboxes/{sid}")


def run(api: httpx.Client, sid: str, cmd: str | list[str], **kw: object) -> dict:
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def ns_addr(server: ServerProcess, sid: str) -> tuple[str, str]:
    """(namespace, address) at which the host reaches this sandbox's guest."""
    spec = json.loads((server.data_dir / "sandboxes" / sid / "machine.json").read_text())
    ns = spec["netns"]
    out = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show", "vpeer"], capture_output=True, text=True).stdout
    return ns, out.split()[3].split("/")[0]
