"""nftables rule sets, as text: the namespace's own table and the host's table.

Kept apart from the code that applies them so they can be read (and tested) as plain text.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from agentenv.errors import InvalidRequest

GUEST_ADDR = "169.254.0.21"
GUEST_GW = "169.254.0.22"
# Fixed link-layer addresses on both ends of the guest link: a restored guest's ARP cache
# (taken in another namespace) stays valid, so its first packet needs no ARP round trip.
GUEST_MAC = "02:ae:00:00:00:01"
TAP_MAC = "02:ae:00:00:00:02"
# Never reachable from a guest, whatever its egress policy: the host, the LAN, other slots,
# the clouds' metadata services (169.254.169.254, Alibaba's 100.100.100.200, and Azure's
# WireServer 168.63.129.16, which hands out a VM's goal state and extension settings), and
# addresses no one routes ("this network", IETF protocol assignments, multicast, reserved).
ALWAYS_DENIED = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "168.63.129.16/32", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
)


def namespace_ruleset(ns_addr: str, dns_addr: str | None = None) -> str:
    """Inside one sandbox namespace: DNAT host→guest, masquerade guest→out, deny private ranges.
    A packet from the guest with any source but the guest's own address is dropped: forged
    sources would leave un-NATed (spoofed traffic from this host) or, as another slot's
    address, open a path to that sandbox through an outside relay. So is one conntrack calls
    invalid (a forged ICMP error, say): it would pass un-NATed too. With ``dns_addr``, DNS
    sent to the guest's gateway goes to the host's forwarder there (network/dns.py), the one
    host address a guest reaches, on port 53 only and whatever its egress policy."""
    denied = ", ".join(ALWAYS_DENIED)
    dns_dnat = (f'iifname "tap0" ip daddr {GUEST_GW} meta l4proto {{ udp, tcp }} th dport 53 dnat to {dns_addr}'
                if dns_addr else "")
    dns_accept = (f'iifname "tap0" oifname "vpeer" ip daddr {dns_addr} meta l4proto {{ udp, tcp }} th dport 53 accept'
                  if dns_addr else "")
    return f"""
table ip aenv {{
  chain egress {{
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "vpeer" ip daddr {ns_addr} dnat to {GUEST_ADDR}
    {dns_dnat}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "vpeer" ip saddr {GUEST_ADDR} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "tap0" ip saddr != {GUEST_ADDR} drop
    ct state invalid drop
    ct state established,related accept
    iifname "vpeer" oifname "tap0" ip daddr {GUEST_ADDR} accept
    {dns_accept}
    iifname "tap0" oifname "vpeer" ip daddr {{ {denied} }} drop
    iifname "tap0" oifname "vpeer" jump egress
    iifname "tap0" oifname "vpeer" accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname "lo" accept
  }}
}}
"""


def host_ruleset(table: str, ifprefix: str, slot_cidr: str, dns_addr: str | None = None,
                 denied: Sequence[str] = ()) -> str:
    """On the host: sandboxes reach neither each other nor the host (but its DNS forwarder on
    port 53, which nothing else but the host reaches); outbound is masqueraded. A connection from a sandbox that the host rewrites to
    another address (a published port: ``docker run -p``, a Kubernetes NodePort, a firewalld
    forward) is dropped: it would be forwarded to a container or service the namespace's
    checks never saw the address of. ``denied``: more networks no sandbox reaches, whatever its
    egress policy (the node's: its uplink's network, AENV_DENY_OUT)."""
    dns = (f'iifname "{ifprefix}*" ip daddr {dns_addr} meta l4proto {{ udp, tcp }} th dport 53 accept'
           if dns_addr else "")
    # The forwarder is for sandboxes (and the host itself): the kernel would take its address
    # from any interface, and a LAN neighbour or a host's container would relay queries into
    # the host's resolvers, loopback-only and internal ones included.
    dns_others = f'ip daddr {dns_addr} iifname != "lo" iifname != "{ifprefix}*" drop' if dns_addr else ""
    deny = f'iifname "{ifprefix}*" ip daddr {{ {", ".join(denied)} }} drop' if denied else ""
    return f"""
table inet {table} {{
  chain input {{
    type filter hook input priority filter; policy accept;
    {dns_others}
    iifname "{ifprefix}*" ct state established,related accept
    {dns}
    iifname "{ifprefix}*" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{ifprefix}*" ct state established,related accept
    iifname "{ifprefix}*" ct status dnat drop
    iifname "{ifprefix}*" ip daddr {slot_cidr} drop
    {deny}
    oifname "{ifprefix}*" ct state new drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {slot_cidr} oifname != "{ifprefix}*" masquerade
  }}
}}
"""


def egress_cidrs(values: list[str] | None, field: str) -> list[str]:
    """Normalise an allow/deny list of IPv4 addresses and CIDRs (``1.2.3.4``, ``10.0.0.0/8``).

    Egress is enforced by address in the namespace's firewall, so host names (``example.com``,
    ``*.example.com``) cannot be honoured and are refused rather than silently ignored."""
    out: list[str] = []
    for raw in values or []:
        value = str(raw).strip()
        try:
            net = ipaddress.ip_network(value, strict=False)
        except ValueError:
            if any(c.isalpha() for c in value):
                raise InvalidRequest(
                    f"{field}: '{value}' is a domain name; AgentENV enforces egress by IP address, "
                    "so give IPv4 addresses or CIDR blocks (e.g. 203.0.113.7 or 203.0.113.0/24)") from None
            raise InvalidRequest(f"{field}: '{value}' is not an IPv4 address or CIDR block") from None
        if net.version != 4:
            raise InvalidRequest(f"{field}: '{value}' is IPv6; sandboxes have IPv4 networking only")
        out.append(str(net))
    return out


def egress_ruleset(allow: list[str], deny: list[str]) -> str:
    """Replace the namespace's egress chain: allow rules beat deny rules; what neither list
    names is allowed. The always-denied ranges are dropped before this chain is reached, so an
    allow rule cannot open them. Established connections are not cut."""
    lines = ["flush chain ip aenv egress"]
    if allow:
        lines.append(f"add rule ip aenv egress ip daddr {{ {', '.join(allow)} }} accept")
    if deny:
        lines.append(f"add rule ip aenv egress ip daddr {{ {', '.join(deny)} }} drop")
    return "\n".join(lines) + "\n"
