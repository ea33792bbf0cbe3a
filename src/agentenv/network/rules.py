"""nftables rule sets, as text: the namespace's own table and the host's table.

Kept apart from the code that applies them so they can be read (and tested) as plain text.
"""

from __future__ import annotations

GUEST_ADDR = "169.254.0.21"
GUEST_GW = "169.254.0.22"
# Fixed link-layer addresses on both ends of the guest link: a restored guest's ARP cache
# (taken in another namespace) stays valid, so its first packet needs no ARP round trip.
GUEST_MAC = "02:ae:00:00:00:01"
TAP_MAC = "02:ae:00:00:00:02"
# Never reachable from a guest, whatever its egress policy (host, LAN, metadata, other slots).
ALWAYS_DENIED = (
    "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/4",
)


def namespace_ruleset(ns_addr: str) -> str:
    """Inside one sandbox namespace: DNAT host→guest, masquerade guest→out, deny private ranges."""
    denied = ", ".join(ALWAYS_DENIED)
    return f"""
table ip aenv {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "vpeer" ip daddr {ns_addr} dnat to {GUEST_ADDR}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "vpeer" ip saddr {GUEST_ADDR} masquerade
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "vpeer" oifname "tap0" ip daddr {GUEST_ADDR} accept
    iifname "tap0" oifname "vpeer" ip daddr {{ {denied} }} drop
    iifname "tap0" oifname "vpeer" accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname "lo" accept
  }}
}}
"""


def host_ruleset(table: str, ifprefix: str, slot_cidr: str) -> str:
    """On the host: sandboxes reach neither each other nor the host; outbound is masqueraded."""
    return f"""
table inet {table} {{
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{ifprefix}*" ct state established,related accept
    iifname "{ifprefix}*" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{ifprefix}*" ct state established,related accept
    iifname "{ifprefix}*" ip daddr {slot_cidr} drop
    oifname "{ifprefix}*" ct state new drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {slot_cidr} oifname != "{ifprefix}*" masquerade
  }}
}}
"""
