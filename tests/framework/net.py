"""Address blocks for test servers.

Every test server gets its own block of host-side addresses inside one test network
(``AENV_TEST_NET``, default 10.216.0.0/16). Two test runs on one machine (e.g. two worktrees)
set different networks so that their namespaces never collide.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import time

import httpx

TEST_NET = ipaddress.ip_network(os.environ.get("AENV_TEST_NET", "10.216.0.0/16"))


def node_cidr(index: int, prefix: int = 24) -> str:
    """The ``index``-th /``prefix`` block of the test network."""
    return str(list(TEST_NET.subnets(new_prefix=prefix))[index])


def wait_for_http(process: subprocess.Popen[bytes], url: str, timeout: float = 60.0) -> None:
    """Wait until the test HTTP server ``process`` answers ``url`` with 200. The bound is
    generous: on a CI machine whose two cores run TCG guests, a Python server can take well
    over ten seconds to start. A server that exits fails at once, with its exit code."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the test HTTP server for {url} exited with code {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"the test HTTP server did not answer {url} within {timeout:.0f} s")
