"""The nftables rule sets are valid for the real nft (checked, not applied)."""

from __future__ import annotations

import os
import subprocess

import pytest

from agentenv.network.rules import host_ruleset, namespace_ruleset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="nft --check needs CAP_NET_ADMIN")


@pytest.mark.parametrize("ruleset", [namespace_ruleset("10.213.0.6"),
                                     host_ruleset("aenv_test", "aetest", "10.213.0.0/16")])
def test_ruleset_is_accepted_by_nft(ruleset: str) -> None:
    r = subprocess.run(["nft", "--check", "-f", "-"], input=ruleset, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_namespace_rules_deny_private_ranges_and_dnat_to_the_guest() -> None:
    rs = namespace_ruleset("10.213.0.6")
    assert "ip daddr 10.213.0.6 dnat to 169.254.0.21" in rs
    for cidr in ("10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"):
        assert cidr in rs
