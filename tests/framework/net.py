"""Address blocks for test servers.

Every test server gets its own block of host-side addresses inside one test network
(``AENV_TEST_NET``, default 10.216.0.0/16). Two test runs on one machine (e.g. two worktrees)
set different networks so that their namespaces never collide.
"""

from __future__ import annotations

import ipaddress
import os

TEST_NET = ipaddress.ip_network(os.environ.get("AENV_TEST_NET", "10.216.0.0/16"))


def node_cidr(index: int, prefix: int = 24) -> str:
    """The ``index``-th /``prefix`` block of the test network."""
    return str(list(TEST_NET.subnets(new_prefix=prefix))[index])
