"""vmm/priority.py: a process made ahead of time runs behind the others, and only it does."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.vmm import priority
from tests.framework.host import cpu_nice

# Raising a priority back needs CAP_SYS_NICE (the server runs as root).
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CAP_SYS_NICE)")


def _own_autogroup() -> str:
    return Path("/proc/self/autogroup").read_text()  # empty in the kernel's default group


@pytest.fixture
def daemon() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own, as a QEMU started with -daemonize is."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def test_a_process_of_its_own_session_is_ranked_down_and_back(daemon: subprocess.Popen[bytes]) -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority.lower(daemon.pid, 10)
    assert cpu_nice(daemon.pid) == {10, min(19, own + 10)}
    priority.restore(daemon.pid)
    assert cpu_nice(daemon.pid) == {0, own}


def test_a_process_of_the_servers_session_leaves_the_servers_group_alone() -> None:
    before = _own_autogroup()
    p = subprocess.Popen(["sleep", "60"])  # same session, so the same autogroup as this process
    try:
        assert priority.lower(p.pid, 10)
        assert _own_autogroup() == before, "the server's own autogroup was ranked down"
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    finally:
        p.kill()
        p.wait()
        if before:  # (empty when this runner has no session: see the next test)
            Path("/proc/self/autogroup").write_text(before.split()[-1])  # whatever happened above


def test_a_server_without_a_session_of_its_own_still_ranks_its_vms_down(
        daemon: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A server run straight from an init or a CI agent that never calls setsid is in the
    kernel's default autogroup, whose /proc/PID/autogroup reads empty. That raised IndexError
    in the launch of every pool VM and left the QEMU running. Stand-in: this test's own
    runner may have a session, so the server's group is made to read as that empty file."""
    real = priority._autogroup
    monkeypatch.setattr(priority, "_autogroup", lambda pid: None if pid == "self" else real(pid))
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert priority.lower(daemon.pid, 10)
    assert cpu_nice(daemon.pid) == {10, min(19, own + 10)}
    priority.restore(daemon.pid)
    assert cpu_nice(daemon.pid) == {0, own}


def test_a_process_gone_meanwhile_is_not_an_error() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    assert priority.lower(p.pid, 10) is False  # nothing to rank, no exception
    priority.restore(p.pid)
