"""vmm/priority.py: a process made ahead of time runs behind the others, and only it does."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.vmm.priority import set_nice
from tests.framework.host import cpu_nice


def _own_autogroup_nice() -> int:
    return int(Path("/proc/self/autogroup").read_text().split()[-1])


@pytest.fixture
def daemon() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own, as a QEMU started with -daemonize is."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def test_a_process_of_its_own_session_is_ranked_down_and_back_up(daemon: subprocess.Popen[bytes]) -> None:
    set_nice(daemon.pid, 10)
    assert cpu_nice(daemon.pid) == {10}
    set_nice(daemon.pid, 0)
    assert cpu_nice(daemon.pid) == {0}


def test_a_process_of_the_servers_session_leaves_the_servers_group_alone() -> None:
    before = _own_autogroup_nice()
    p = subprocess.Popen(["sleep", "60"])  # same session, so the same autogroup as this process
    try:
        set_nice(p.pid, 10)
        assert _own_autogroup_nice() == before, "the server's own autogroup was ranked down"
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == 10, "its thread is still ranked down"
    finally:
        p.kill()
        p.wait()


def test_a_process_gone_meanwhile_is_not_an_error() -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    set_nice(p.pid, 10)  # nothing to rank: no exception
