"""Network slots: a namespace + veth pair + tap, created ahead of time and reused.

Slot ``i`` owns the /30 number ``i`` of the slot CIDR: ``.1`` on the host side of the veth,
``.2`` on the namespace side (the address the host uses to reach the guest).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pyroute2.conntrack import AsyncConntrack, NFCTAttrTuple

from agentenv.errors import CapacityExhausted, ExternalCommandError, NetworkError
from agentenv.network.rules import (
    GUEST_ADDR,
    GUEST_GW,
    GUEST_MAC,
    TAP_MAC,
    egress_ruleset,
    host_ruleset,
    namespace_ruleset,
)
from agentenv.proc import run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slot:
    index: int
    netns: str
    veth: str  # host-side interface
    host_addr: str
    ns_addr: str  # the host reaches the guest at this address
    dns_addr: str | None = None  # the host's DNS forwarder, which the namespace sends DNS to

    @property
    def guest_url(self) -> str:
        return f"http://{self.ns_addr}:49983"

    def url(self, port: int) -> str:
        """Where the host reaches ``port`` of the guest (the namespace DNATs every port)."""
        return f"http://{self.ns_addr}:{port}"


class SlotPool:
    """Allocates slot indices and keeps ``target`` slots ready to hand out."""

    def __init__(self, tag: str, cidr: str, target: int, dns: bool = True) -> None:
        self.tag = tag
        self.dns = dns  # namespaces send their guest's DNS to the host's forwarder
        self.net = ipaddress.ip_network(cidr)
        self.capacity = self.net.num_addresses // 4 - 1  # /30 number 0 is never used
        self.target = min(target, self.capacity // 2)  # a small block keeps room for sandboxes
        self._used: set[int] = set()
        self._ready: list[Slot] = []
        self._lock = asyncio.Lock()

    @property
    def ifprefix(self) -> str:
        return _ifprefix(self.tag)

    @property
    def dns_addr(self) -> str:
        """The forwarder's address: the first of /30 number 0, which no slot uses."""
        return str(self.net.network_address + 1)

    def slot(self, index: int) -> Slot:
        base = int(self.net.network_address) + 4 * index
        return Slot(
            index=index,
            netns=f"{_netns_prefix(self.tag)}{index}",
            veth=f"{self.ifprefix}{index}",
            host_addr=str(ipaddress.ip_address(base + 1)),
            ns_addr=str(ipaddress.ip_address(base + 2)),
            dns_addr=self.dns_addr if self.dns else None,
        )

    def mark_used(self, index: int) -> None:
        """Record a slot held by an adopted sandbox (server restart)."""
        self._used.add(index)

    async def acquire(self) -> Slot:
        async with self._lock:
            if self._ready:
                return self._ready.pop()
            index = self._next_index()
        try:
            return await create_slot(self.slot(index))
        except BaseException:
            self._used.discard(index)
            raise

    async def release(self, slot: Slot) -> None:
        """Destroy the slot (its namespace may hold conntrack state of the old sandbox). Its
        index is free again only once its namespace is gone: freed after a failure (``ip``
        could not be started), a new sandbox would get a namespace of the same name, which a
        retried release of this slot would then delete under it."""
        await destroy_slot(slot)
        self._used.discard(slot.index)

    async def fill(self) -> None:
        """Top the ready list up to ``target`` (run by the pool keeper in the background)."""
        while len(self._ready) < self.target:
            async with self._lock:
                index = self._next_index()
            try:
                s = await create_slot(self.slot(index))
            except BaseException:
                self._used.discard(index)
                raise
            self._ready.append(s)

    async def drain(self) -> None:
        while self._ready:
            await self.release(self._ready.pop())

    def _next_index(self) -> int:
        for i in range(1, self.capacity + 1):
            if i not in self._used:
                self._used.add(i)
                return i
        # A node full by its slot range, as by its count limit: the caller may retry (429).
        raise CapacityExhausted(f"all {self.capacity} network slots of {self.net} are in use; kill or pause "
                                f"some sandboxes, or give the node a larger AENV_SLOT_CIDR", retry_after=5)

    async def remove_orphans(self, keep: set[int]) -> list[str]:
        """Delete namespaces of ours that no sandbox owns (left by a crashed server)."""
        return await remove_namespaces(self.tag, keep)


def _ifprefix(tag: str) -> str:
    return f"ae{tag[:4]}"


def _dns_label(tag: str) -> str:
    return f"lo:{_ifprefix(tag)}"


def _netns_prefix(tag: str) -> str:
    return f"aenv-{tag[:4]}-"


async def remove_namespaces(tag: str, keep: Collection[int] = ()) -> list[str]:
    """Delete the slot namespaces of node ``tag`` whose index is not in ``keep``, each with its
    host veth first (the kernel tears a namespace down later, and a lingering veth would keep
    its address)."""
    out = await run(["ip", "netns", "list"], check=False)
    prefix = _netns_prefix(tag)
    removed = []
    for line in out.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(prefix) and (idx := int(name.removeprefix(prefix))) not in keep:
            await _destroy(f"{_ifprefix(tag)}{idx}", name)
            removed.append(name)
    return removed


async def forget_connections(addr: str) -> int:
    """Delete the host's conntrack entries from or to ``addr`` (a slot's namespace address);
    how many. The host's table outlives a slot: an entry of the sandbox that had this address
    before (a UDP flow a remote peer keeps alive, a TCP connection) would carry the peer's
    packets into the next sandbox given the address, as established traffic its egress policy
    never sees. Best effort: without conntrack's netlink interface there is nothing to delete."""
    removed = 0
    ct = AsyncConntrack()
    try:
        await ct.setup_endpoint()
        for field in ("saddr", "daddr"):
            entries = [e async for e in await ct.dump_entries(tuple_orig=NFCTAttrTuple(**{field: addr}))]
            for entry in entries:
                with contextlib.suppress(Exception):  # gone meanwhile (expired, or deleted by its peer's RST)
                    await ct.delete(entry)
                    removed += 1
    except Exception as exc:  # noqa: BLE001 — best effort, logged
        log.warning("could not clear conntrack entries of %s: %r", addr, exc)
    finally:
        ct.close()
    return removed


async def create_slot(slot: Slot) -> Slot:
    """Build namespace, veth pair, tap and rules. On failure nothing is left behind. The host
    forgets every connection of the slot's address first (``forget_connections``)."""
    await forget_connections(slot.ns_addr)
    host_cmds = "\n".join([
        f"netns add {slot.netns}",
        f"link add {slot.veth} type veth peer name vpeer netns {slot.netns}",
        f"addr add {slot.host_addr}/30 dev {slot.veth}",
        f"link set {slot.veth} up",
    ]) + "\n"
    ns_script = (
        "set -e\n"
        "echo 1 > /proc/sys/net/ipv4/ip_forward\n"
        "ip -batch - <<'EOF'\n"
        "link set lo up\n"
        "link set vpeer up\n"
        f"addr add {slot.ns_addr}/30 dev vpeer\n"
        f"route add default via {slot.host_addr}\n"
        "tuntap add dev tap0 mode tap\n"
        f"link set tap0 address {TAP_MAC}\n"
        f"addr add {GUEST_GW}/30 dev tap0\n"
        "link set tap0 up\n"
        f"neigh replace {GUEST_ADDR} lladdr {GUEST_MAC} dev tap0 nud permanent\n"
        "EOF\n"
        "nft -f - <<'EOF'\n"
        f"{namespace_ruleset(slot.ns_addr, slot.dns_addr)}\n"
        "EOF\n"
    )
    try:
        await run(["ip", "-batch", "-"], input=host_cmds.encode())
        await run(["ip", "netns", "exec", slot.netns, "sh", "-c", ns_script])
    except BaseException as exc:
        # Whatever stopped it (a command that failed, one that could not start, a cancelled
        # create): what was made goes, or the next slot of this index would meet it ("File
        # exists"). Shielded, so that a cancellation does not cut the clean-up short.
        with contextlib.suppress(Exception):
            await asyncio.shield(destroy_slot(slot))
        if isinstance(exc, ExternalCommandError):
            raise NetworkError(f"cannot create network slot {slot.netns}: {exc.message}") from exc
        raise
    return slot


async def set_egress(slot: Slot, allow: list[str], deny: list[str]) -> None:
    """Replace the slot's egress rules (``egress_ruleset``) in one nft transaction."""
    try:
        await run(["ip", "netns", "exec", slot.netns, "nft", "-f", "-"], input=egress_ruleset(allow, deny).encode())
    except ExternalCommandError as exc:
        raise NetworkError(f"cannot set the egress rules of {slot.netns}: {exc.message}") from exc


async def destroy_slot(slot: Slot) -> None:
    """Remove the namespace (which removes vpeer, tap0 and the rules) and the host veth."""
    await _destroy(slot.veth, slot.netns)


async def _destroy(veth: str, netns: str) -> None:
    await run(["ip", "link", "del", veth], check=False)
    await run(["ip", "netns", "del", netns], check=False)


async def host_firewall_up(tag: str, ifprefix: str, cidr: str, dns_addr: str | None = None,
                           denied: Sequence[str] = ()) -> None:
    """Install the host table (idempotent) and enable forwarding for outbound traffic. The old
    table (a restart) is replaced in the same transaction: its sandboxes, which outlive the
    server, are never without the rules that keep them apart. With ``dns_addr``, that address
    is put on the host for the DNS forwarder to listen on. ``denied``: networks no sandbox
    reaches (``host_ruleset``)."""
    table = f"aenv_{tag[:4]}"
    replace = f"add table inet {table}\ndelete table inet {table}\n"
    await _refuse_shared_cidr(tag, ifprefix, cidr)
    try:
        ruleset = host_ruleset(table, ifprefix, cidr, dns_addr, denied)
        await run(["nft", "-f", "-"], input=(replace + ruleset).encode())
        await run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        # The forwarder's address on the loopback device, labelled as this node's (kernels
        # without the dummy driver are common in VMs); an earlier run's, maybe of another
        # CIDR, goes first.
        await run(["ip", "addr", "flush", "dev", "lo", "label", _dns_label(tag)], check=False)
        if dns_addr:  # (a node killed earlier may have left it under another label)
            await run(["ip", "addr", "del", f"{dns_addr}/32", "dev", "lo"], check=False)
            await run(["ip", "addr", "add", f"{dns_addr}/32", "dev", "lo", "label", _dns_label(tag)])
    except ExternalCommandError as exc:
        raise NetworkError(
            f"cannot install host firewall (AgentENV needs root / CAP_NET_ADMIN): {exc.message}"
        ) from exc


async def uplink_networks() -> list[str]:
    """The IPv4 networks of the interfaces the host's default routes leave by: the LAN the host
    sits on (its neighbours, its gateway's management addresses), which a guest has no business
    reaching even when it is not a private range (hosts with public addresses, a provider's
    network)."""
    routes = await run(["ip", "-4", "route", "show", "default"], check=False)  # default via GW dev DEV ...
    devs = {f[f.index("dev") + 1] for f in map(str.split, routes.splitlines()) if "dev" in f[:-1]}
    addrs = _addresses(await run(["ip", "-4", "-o", "addr"], check=False))
    return list(dict.fromkeys(str(addr.network) for dev, addr, _ in addrs if dev in devs))


async def _refuse_shared_cidr(tag: str, ifprefix: str, cidr: str) -> None:
    """Two nodes on one host with the same slot CIDR (both left at the default) gave their
    sandboxes the same addresses, and one node's traffic reached the other's guests. An
    address of the CIDR on an interface that is not this node's means another user of it."""
    net = ipaddress.ip_network(cidr)
    for dev, addr, label in _addresses(await run(["ip", "-4", "-o", "addr"], check=False)):
        if addr.ip in net and not dev.startswith(ifprefix) and label != _dns_label(tag):
            if label.startswith("lo:ae") or dev.startswith("ae"):
                what = f"another AgentENV node ({label})"
            else:
                what = f"interface {label}"
            raise NetworkError(f"the slot CIDR {cidr} is in use on this host: {addr} on {what}; give each node "
                               "its own AENV_SLOT_CIDR (or remove what holds that address)")


def _addresses(ip_o_addr: str) -> list[tuple[str, ipaddress.IPv4Interface | ipaddress.IPv6Interface, str]]:
    """(device, address, label) of each line of ``ip -4 -o addr``:
    ``N: dev inet ADDR ... scope S LABEL\\ valid_lft ...``."""
    out = []
    for line in ip_o_addr.splitlines():
        fields = line.split("\\")[0].split()
        if len(fields) >= 4 and fields[2] == "inet":
            out.append((fields[1].split("@")[0], ipaddress.ip_interface(fields[3]), fields[-1]))
    return out


async def host_firewall_down(tag: str) -> None:
    await run(["nft", "delete", "table", "inet", f"aenv_{tag[:4]}"], check=False)
    await run(["ip", "addr", "flush", "dev", "lo", "label", _dns_label(tag)], check=False)


async def remove_node_network(tag: str) -> list[str]:
    """Every network object of the node ``tag``: its namespaces with their veths, and its host
    table. For a node that is gone for good; the caller makes sure no live node shares the
    tag's first four characters, which name them."""
    removed = await remove_namespaces(tag)
    await host_firewall_down(tag)
    return [*removed, f"nft table aenv_{tag[:4]}"]


def remove_slots_in(cidr: str) -> list[str]:
    """Remove host veths and namespaces holding addresses of ``cidr``, whatever node made them.

    A node's own orphans are found by name (``SlotPool.remove_orphans``); this is for a
    throwaway node (benchmark, tests) about to use a fixed address block that a run killed
    earlier may have left behind: a stale veth with the same address would shadow the route to
    a new sandbox. Blocking; call it before the node starts."""
    import subprocess

    net = ipaddress.ip_network(cidr)
    removed = []
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, check=False, text=True).stdout
    for dev, addr, label in _addresses(out):
        if dev.startswith("ae") and addr.ip in net:
            subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)
            removed.append(dev)
        elif dev == "lo" and label.startswith("lo:ae") and addr.ip in net:  # a DNS address
            subprocess.run(["ip", "addr", "del", str(addr), "dev", "lo"], capture_output=True, check=False)
            removed.append(label)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, check=False, text=True).stdout
    for line in names.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if not ns.startswith("aenv-"):
            continue
        a = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show", "vpeer"], capture_output=True, check=False,
                           text=True).stdout
        if a.strip() and ipaddress.ip_interface(a.split()[3]).ip in net:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            removed.append(ns)
    return removed
