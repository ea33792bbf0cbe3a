"""Per-sandbox networking: a network namespace per sandbox with a TAP for the guest.

Every guest has the same address (169.254.0.21/30) so snapshots and forks stay valid; the host
reaches guest N through the namespace side of its veth pair, which DNATs to the guest. See
docs/mechanisms/networking.md.
"""

from agentenv.network.dns import DnsForwarder, host_resolvers, parse_upstreams
from agentenv.network.rules import egress_cidrs
from agentenv.network.slots import (
    Slot,
    SlotPool,
    host_firewall_up,
    remove_node_network,
    remove_slots_in,
    set_egress,
    uplink_networks,
)

__all__ = ["DnsForwarder", "Slot", "SlotPool", "egress_cidrs", "host_firewall_up", "host_resolvers",
           "parse_upstreams", "remove_node_network", "remove_slots_in", "set_egress", "uplink_networks"]
