"""A throwaway AgentENV node: the real server as a subprocess with its own data dir, port and
slot CIDR, reusing the provisioned kernel and images.

``aenv bench`` measures against one; the tests use the same class, and stop it with SIGTERM or
SIGKILL to exercise restart and re-adoption.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from agentenv.config import Settings
from agentenv.images import artifacts_present
from agentenv.network import SlotPool, host_firewall_up
from agentenv.orchestrator import State
from agentenv.orchestrator.leftovers import remove_node_objects
from agentenv.vmm import find_qemu_pids, kill_pid

CACHE = Path(os.environ.get("AENV_CACHE_DIR", "/var/lib/agentenv/cache"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_images(cache: Path) -> None:
    if artifacts_present(cache) is None:
        raise RuntimeError(f"no provisioned guest images in {cache}: run `aenv setup` (or scripts/install) first")


@contextlib.asynccontextmanager
async def scratch_host(data_dir: Path, slot_cidr: str) -> AsyncIterator[tuple[Settings, SlotPool]]:
    """The host side of a measurement that runs machines without a server (cold boot, plain
    QEMU migration): its own instance tag, slots on ``slot_cidr`` and firewall table, and its
    memory and QMP socket folders, all removed afterwards (they are on tmpfs: /dev/shm, /run)."""
    settings = Settings(data_dir=data_dir)
    slots = SlotPool(settings.instance_tag, slot_cidr, 0)
    await host_firewall_up(settings.instance_tag, slots.ifprefix, slot_cidr)
    settings.mem_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield settings, slots
    finally:
        await remove_node_objects(settings.instance_tag, settings.mem_dir, settings.sock_dir)


class LocalNode:
    def __init__(self, data_dir: Path, slot_cidr: str, cache: Path = CACHE, **env: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "AENV_DATA_DIR": str(data_dir),
            "AENV_CACHE_DIR": str(cache),
            "AENV_PORT": str(self.port),
            "AENV_SLOT_CIDR": slot_cidr,
            "AENV_POOL_SIZE": "1",
            "AENV_SLOT_POOL_SIZE": "2",
            # No primed shells of snapshots: a test starting from a snapshot must not leave VMs
            # made in the background (tests/e2e/test_snapshot_shells.py tests them).
            "AENV_SNAPSHOT_POOL_SIZE": "0",
            # A pause frees the VM at once, so resumes restore from the saved state. Parked
            # VMs (the default) are tested by tests/e2e/test_parked.py and the E2B SDK tests.
            "AENV_PAUSE_LINGER_S": "0",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.parent.with_name(data_dir.parent.name + "-server.log")

    def start(self, timeout: float = 60.0) -> None:
        require_images(Path(self.env["AENV_CACHE_DIR"]))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.log, "ab")
        # --pdeathsig: the node dies with whoever started it. A benchmark or test run that is
        # killed must not leave a server behind that keeps refilling its pool on a fixed address
        # block (the next run would share it, and their sandboxes' slots collide).
        self.proc = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", sys.executable, "-m", "agentenv.server"],
                                     env=self.env, stdout=logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 204:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not answer within {timeout}s: {self.log.read_text()[-3000:]}")

    @property
    def api_key(self) -> str:
        return (self.data_dir / "api_key").read_text().strip()

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key}, timeout=timeout)

    def details(self) -> dict[str, Any]:
        """The node's GET /health/details (pool fill, parked VMs, accelerator...)."""
        r = httpx.get(self.url + "/health/details", headers={"X-API-Key": self.api_key}, timeout=30)
        r.raise_for_status()
        return r.json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.proc = None

    def kill_all(self) -> None:
        """Teardown: kill every sandbox through the API, stop the server, and remove the
        node's host-wide leftovers (memory files on tmpfs, nft table, socket dir).

        A sandbox whose create was still in flight when the list was taken is not killed
        through the API, and a stopped server leaves running sandboxes for its next start by
        design: whatever QEMU or namespace of this node is left after the stop is removed here."""
        if self.proc is not None:
            try:
                with self.client() as c:
                    for sb in all_sandboxes(c):
                        c.delete(f"/sandboxes/{sb['sandboxID']}")
            except httpx.HTTPError:  # a server that does not answer: what it left goes below
                pass
            proc = self.proc
            try:
                self.stop()
            except subprocess.TimeoutExpired:  # a server stuck in its stop: it goes too
                proc.kill()
                proc.wait()
        settings = Settings(data_dir=self.data_dir)
        for pid in qemu_pids(str(self.data_dir)):
            kill_pid(pid)
        qemu_gone(str(self.data_dir))
        asyncio.run(remove_node_objects(settings.instance_tag, settings.mem_dir, settings.sock_dir))


def all_sandboxes(api: httpx.Client) -> list[dict]:
    """Every sandbox of the node, whatever its state (a plain list shows running and paused)."""
    r = api.get("/sandboxes", params={"state": ",".join(s.value for s in State)})
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def qemu_pids(marker: str) -> set[int]:
    """Pids of QEMU processes whose command line contains ``marker`` (a data dir or an id)."""
    return set(find_qemu_pids(marker))


def qemu_gone(marker: str, timeout: float = 10.0) -> bool:
    """Whether every QEMU matching ``marker`` has exited within ``timeout`` (a killed process,
    or one a pause frees in the background after its answer)."""
    deadline = time.monotonic() + timeout
    while qemu_pids(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def pss_kb(pid: int) -> int:
    """Proportional set size of a process (shared pages split between their users)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0
