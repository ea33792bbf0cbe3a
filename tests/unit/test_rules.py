"""The nftables rule sets are valid for the real nft (checked, not applied)."""

from __future__ import annotations

import os
import subprocess

import pytest

from agentenv.network.rules import host_ruleset, namespace_ruleset

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="nft --check needs CAP_NET_ADMIN")


@pytest.mark.parametrize("ruleset", [namespace_ruleset("10.213.0.6"),
                                     namespace_ruleset("10.213.0.6", "10.213.0.1"),
                                     host_ruleset("aenv_test", "aetest", "10.213.0.0/16"),
                                     host_ruleset("aenv_test", "aetest", "10.213.0.0/16", "10.213.0.1")])
def test_ruleset_is_accepted_by_nft(ruleset: str) -> None:
    r = subprocess.run(["nft", "--check", "-f", "-"], input=ruleset, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_namespace_rules_deny_private_ranges_and_dnat_to_the_guest() -> None:
    rs = namespace_ruleset("10.213.0.6")
    assert "ip daddr 10.213.0.6 dnat to 169.254.0.21" in rs
    for cidr in ("10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16",
                 "168.63.129.16", "100.64.0.0/10", "240.0.0.0/4"):  # (Azure's WireServer, Alibaba's metadata)
        assert cidr in rs


def test_dns_for_the_gateway_goes_to_the_forwarder_and_port_53_only_passes() -> None:
    rs = namespace_ruleset("10.213.0.6", "10.213.0.1")
    assert 'ip daddr 169.254.0.22 meta l4proto { udp, tcp } th dport 53 dnat to 10.213.0.1' in rs
    accept = rs.index("ip daddr 10.213.0.1 meta l4proto { udp, tcp } th dport 53 accept")
    assert accept < rs.index("ip daddr { 0.0.0.0/8"), "the forwarder is let through before the private ranges drop"
    host = host_ruleset("aenv_test", "aetest", "10.213.0.0/16", "10.213.0.1")
    assert host.index("th dport 53 accept") < host.index('iifname "aetest*" drop')
    # ... and only from sandboxes and the host itself: not from the LAN or the host's containers.
    assert 'ip daddr 10.213.0.1 iifname != "lo" iifname != "aetest*" drop' in host


def test_upstreams_come_from_the_setting_or_the_hosts_resolv_conf(tmp_path) -> None:
    from agentenv.network.dns import host_resolvers, parse_upstreams

    conf = tmp_path / "resolv.conf"
    conf.write_text("# comment\nnameserver 127.0.0.53\nnameserver fe80::1%eth0\nnameserver bogus\nsearch x\n")
    assert host_resolvers(conf) == [("127.0.0.53", 53), ("fe80::1%eth0", 53)]
    assert host_resolvers(tmp_path / "missing") == []
    assert parse_upstreams("127.0.0.1:5353, 9.9.9.9") == [("127.0.0.1", 5353), ("9.9.9.9", 53)]
    with pytest.raises(ValueError, match="AENV_DNS_UPSTREAM"):
        parse_upstreams("dns.example")
