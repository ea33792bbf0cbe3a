"""Egress lists are checked and rendered as nft rules the real nft accepts."""

from __future__ import annotations

import os
import subprocess

import pytest

from agentenv.errors import InvalidRequest
from agentenv.network.rules import egress_cidrs, egress_ruleset, namespace_ruleset


def test_addresses_and_cidrs_are_normalised() -> None:
    assert egress_cidrs(["1.2.3.4", "10.1.2.3/8", " 0.0.0.0/0 "], "f") == ["1.2.3.4/32", "10.0.0.0/8", "0.0.0.0/0"]
    assert egress_cidrs(None, "f") == []


@pytest.mark.parametrize(("value", "words"), [
    ("example.com", "is a domain name"), ("*.example.com", "is a domain name"),
    ("300.1.2.3", "is not an IPv4 address"), ("1.2.3.4/33", "is not an IPv4 address"),
    ("2001:db8::/32", "is IPv6"),
])
def test_what_cannot_be_enforced_by_address_is_refused(value: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        egress_cidrs([value], "network.allowOut")
    assert e.value.message.startswith(f"network.allowOut: '{value}' {words}")


def test_allow_comes_before_deny_and_an_update_replaces_the_chain() -> None:
    rs = egress_ruleset(["1.2.3.4/32"], ["0.0.0.0/0"])
    lines = rs.splitlines()
    assert lines[0] == "flush chain ip aenv egress"
    assert "accept" in lines[1] and "1.2.3.4/32" in lines[1]
    assert "drop" in lines[2] and "0.0.0.0/0" in lines[2]
    assert egress_ruleset([], []) == "flush chain ip aenv egress\n"


def test_private_ranges_are_dropped_before_the_egress_chain() -> None:
    rs = namespace_ruleset("10.213.0.6")
    assert rs.index("ip daddr { 0.0.0.0/8") < rs.index("jump egress") < rs.index('oifname "vpeer" accept')


@pytest.mark.skipif(os.geteuid() != 0, reason="nft --check needs CAP_NET_ADMIN")
def test_nft_accepts_the_namespace_table_with_egress_rules() -> None:
    text = namespace_ruleset("10.213.0.6") + egress_ruleset(["1.2.3.4/32", "8.8.0.0/16"], ["0.0.0.0/0"])
    r = subprocess.run(["nft", "--check", "-f", "-"], input=text, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
