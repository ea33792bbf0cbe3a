"""Session set-up shared by every test folder.

Test servers use addresses in AENV_TEST_NET (10.216.0.0/16 by default) and data dirs under pytest's temporary root. A test
run that was itself killed (not a server crash, which the servers recover from) can leave their
QEMU processes and namespaces behind; they would collide with this run's addresses, so they are
swept once at the start.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from agentenv.config import Settings
from agentenv.network import remove_slots_in
from tests.framework import host
from tests.framework.net import TEST_NET


def _sweep_stale_test_nodes() -> None:
    # Processes a test froze (tests/framework/host.py frozen) and did not thaw (the run was
    # killed): thawed first, or they would outlive the SIGKILL below.
    for group in host.FREEZER.glob("aenv-test-*"):
        with contextlib.suppress(OSError):
            host.thaw(group)
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"qemu-system") and b"/pytest-of-" in cmd:
                os.kill(int(p.name), signal.SIGKILL)
    # Veths, namespaces and DNS forwarder addresses (lo:ae<tag>) in the test network: a new node
    # refuses a slot CIDR another node's address is in ("in use on this host").
    remove_slots_in(str(TEST_NET))
    for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if ns.startswith("aenv-") and not subprocess.run(  # half-made: no address yet
                ["ip", "-n", ns, "-4", "-o", "addr", "show", "vpeer"], capture_output=True, text=True).stdout.strip():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    # Their host nft tables (named by tag, so found by the addresses in their rules).
    for line in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout.splitlines():
        name = line.split()[-1] if line.startswith("table inet aenv_") else ""
        if name:
            rules = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True).stdout
            if any(ipaddress.ip_network(a, strict=False).overlaps(TEST_NET) for a in _addresses(rules)):
                subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True)
    # Their memory files on tmpfs (RAM: a node short of memory refuses creates) and socket dirs.
    for data in Path("/tmp").glob("pytest-of-*/pytest-*/*/data"):
        node = Settings(data_dir=data)
        for d in (node.mem_dir, node.sock_dir):
            shutil.rmtree(d, ignore_errors=True)


def _addresses(text: str) -> list[str]:
    """IPv4 addresses and networks named in ``text`` (an nft ruleset)."""
    return re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}(?:/\d{1,2})?\b", text)


def _other_pytest_running() -> bool:
    me = os.getpid()
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != me:
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"pytest" in cmd and b"python" in cmd.split(b"\0")[0]:
                return True
    return False


# A runner that starts the tests as a background job of a non-interactive shell (`cmd &`) hands
# them SIGINT ignored, and every process they start would inherit that: a Ctrl-C test of `aenv`
# would then test nothing. Python's own handler makes the children start with the default.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _clean_host() -> None:
    """Sweep only when no other test run is alive: its VMs are not stale."""
    if os.geteuid() == 0 and not _other_pytest_running():
        _sweep_stale_test_nodes()
