"""Each sandbox has its own network namespace; sandboxes reach neither each other nor the host."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ns_addr, run
from tests.framework.net import TEST_NET, node_cidr, wait_for_http
from tests.framework.server import ServerProcess


def test_sandboxes_are_isolated_from_each_other_and_the_host(api: httpx.Client, server: ServerProcess) -> None:
    a = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    b = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list[object] = []
    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener is closed at the end: nobody came
            accepted.append(listener.accept())

    threading.Thread(target=accept, daemon=True).start()
    try:
        ns_a, _ = ns_addr(server, a)
        ns_b, addr_b = ns_addr(server, b)
        assert ns_a != ns_b
        # Same guest address in both (the snapshot ABI), different namespaces.
        ips = [run(api, s, "ip -4 -o addr show eth0")["stdout"].split()[3] for s in (a, b)]
        assert ips[0] == ips[1] == "169.254.0.21/30"
        # The host reaches B's agent at its namespace address...
        assert httpx.get(f"http://{addr_b}:49983/health", timeout=5).status_code == 204
        # ...but A cannot.
        r = run(api, a, f"curl -s -m 2 http://{addr_b}:49983/health; echo rc=$?")
        assert "rc=0" not in r["stdout"], r
        # Nor can A reach a service on the host, through its gateway or the host's own address.
        host_ips = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        gw = run(api, a, "ip route show default")["stdout"].split()[2]
        for target in [gw, *host_ips[:1]]:
            r = run(api, a, f"curl -s -m 2 http://{target}:{port}/; echo rc=$?")
            assert "rc=0" not in r["stdout"] and "rc=52" not in r["stdout"], (target, r)
        assert accepted == []
    finally:
        listener.close()
        for s in (a, b):
            api.delete(f"/sandboxes/{s}")


def _sh(*argv: str, check: bool = True) -> None:
    subprocess.run(argv, check=check, capture_output=True)


@contextlib.contextmanager
def service_behind_host(net: ipaddress.IPv4Network, name: str) -> Iterator[str]:
    """An HTTP server (port 8080) in a namespace of its own behind the host, as a container or
    a LAN neighbour is: the host routes ``net`` (a /30) to it over a veth. Yields its address."""
    n = TEST_NET.network_address.packed[1]
    host_end, svc_ip = str(net[1]), str(net[2])
    ns, veth = f"aenv-test-{name}{n}", f"t{name}{n}"

    def clean() -> None:
        _sh("ip", "link", "del", veth, check=False)
        _sh("ip", "netns", "del", ns, check=False)

    clean()
    service = None
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "svc0", "netns", ns)
        _sh("ip", "addr", "add", f"{host_end}/30", "dev", veth)
        _sh("ip", "link", "set", veth, "up")
        for cmd in (["addr", "add", f"{svc_ip}/30", "dev", "svc0"], ["link", "set", "svc0", "up"],
                    ["link", "set", "lo", "up"], ["route", "add", "default", "via", host_end]):
            _sh("ip", "-n", ns, *cmd)
        service = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "http.server", "8080",
                                    "--bind", svc_ip, "--directory", "/etc"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_http(service, f"http://{svc_ip}:8080/hostname")
        yield svc_ip
    finally:
        if service is not None:
            service.kill()
            service.wait()
        clean()


def fetch(api: httpx.Client, sid: str, url: str) -> str:
    """What a guest's curl of ``url`` gives: the HTTP status and curl's exit code."""
    return run(api, sid, f"curl -s -m 3 -o /dev/null -w '%{{http_code}}' {url}; echo ' rc='$?")["stdout"]


def test_a_port_the_host_publishes_by_dnat_is_no_way_out(api: httpx.Client, server: ServerProcess) -> None:
    """``docker run -p``, a Kubernetes NodePort: the host rewrites connections to one of its
    ports into connections to a container. A guest must not get through such a port to a
    service it may not reach directly (here one on a private address, in a namespace of its
    own behind the host, as a container is)."""
    table = f"aenvtest_dnat{TEST_NET.network_address.packed[1]}"
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    try:
        with service_behind_host(next(ipaddress.ip_network(node_cidr(49)).subnets(new_prefix=30)), "svc") as svc_ip:
            rules = (f"table ip {table} {{\n chain pre {{\n type nat hook prerouting priority dstnat; policy accept;\n"
                     f" ip daddr {host_ip} tcp dport 18080 dnat to {svc_ip}:8080\n }}\n}}\n")
            subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True, capture_output=True)
            out = fetch(api, sid, f"http://{host_ip}:18080/hostname")
            assert "200" not in out and "rc=0" not in out, out
    finally:
        _sh("nft", "delete", "table", "ip", table, check=False)
        api.delete(f"/sandboxes/{sid}")


def test_networks_the_node_denies_are_reached_by_no_sandbox(api: httpx.Client, tmp_path: Path) -> None:
    """AENV_DENY_OUT: networks of the operator's (here a public-range one behind the host,
    which the default node's sandboxes reach) that no sandbox reaches, whatever its allowOut;
    and by default the network of the host's uplink (its LAN neighbours)."""
    n = TEST_NET.network_address.packed[1]
    net = ipaddress.ip_network(f"198.18.{n}.4/30")
    node = ServerProcess(tmp_path / "data", node_cidr(54), AENV_POOL_SIZE="0", AENV_DENY_OUT=str(net))
    node.start()
    try:
        with service_behind_host(net, "lan") as svc_ip, node.client() as own:
            open_sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
            try:
                assert "200 rc=0" in fetch(api, open_sid, f"http://{svc_ip}:8080/hostname")  # reachable by default
            finally:
                api.delete(f"/sandboxes/{open_sid}")
            sid = own.post("/sandboxes", json={"templateID": "base", "network": {"allowOut": [str(net)]}}
                           ).json()["sandboxID"]
            out = fetch(own, sid, f"http://{svc_ip}:8080/hostname")
            assert "200" not in out and "rc=0" not in out, out
        uplink = subprocess.run(["ip", "-j", "-4", "route", "show", "default"], capture_output=True, text=True).stdout
        if json.loads(uplink or "[]"):
            table = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
            dev = json.loads(uplink)[0]["dev"]
            addr = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show", "dev", dev], capture_output=True,
                                             text=True).stdout)[0]["addr_info"][0]
            lan = str(ipaddress.ip_interface(f"{addr['local']}/{addr['prefixlen']}").network)
            assert f"{lan}, {net}" in table or f"{net}, {lan}" in table, "the uplink's network is not denied"
    finally:
        node.kill_all()


def test_a_guest_sends_nothing_out_before_its_sandbox_has_a_policy(tmp_path: Path) -> None:
    """A shell's guest runs before its create applies the sandbox's egress policy (priming; or,
    here, a shell made inline with no pool): its namespace denies every outbound connection
    meanwhile, then holds the sandbox's policy (the default: no egress rule)."""
    s = ServerProcess(tmp_path / "data", node_cidr(41), AENV_POOL_SIZE="0", AENV_SLOT_POOL_SIZE="0")
    s.start()

    def egress(ns: str) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "chain", "ip", "aenv", "egress"],
                              capture_output=True, text=True).stdout

    try:
        with s.client() as api:
            api.delete(f"/sandboxes/{api.post('/sandboxes', json={'templateID': 'base'}).json()['sandboxID']}")
            seen: set[str] = set()

            def create() -> httpx.Response:
                with s.client() as other:
                    return other.post("/sandboxes", json={"templateID": "base"})

            with ThreadPoolExecutor(1) as ex:
                pending = ex.submit(create)
                while not pending.done():
                    for spec in (s.data_dir / "sandboxes").glob("*/machine.json"):
                        rules = egress(json.loads(spec.read_text())["netns"])
                        if "0.0.0.0/0" in rules and "drop" in rules:
                            seen.add(spec.parent.name)
                sid = pending.result().json()["sandboxID"]
            assert sid in seen, "the guest ran with no policy: outbound traffic was not denied"
            ns, _ = ns_addr(s, sid)
            assert "drop" not in egress(ns), "the sandbox's own policy (none) replaced the denial"
            assert run(api, sid, "echo ok")["stdout"] == "ok\n"
    finally:
        s.kill_all()


def test_a_node_refuses_a_slot_cidr_another_user_holds(tmp_path: Path) -> None:
    """Two nodes left at the default slot CIDR gave their sandboxes the same addresses without
    a word, and one node's traffic went to the other's guests. Now the second one refuses to
    start, naming the setting; once the address is gone it starts."""
    cidr = node_cidr(43)
    held = cidr.split("/")[0].rsplit(".", 1)[0] + ".9/30"
    subprocess.run(["ip", "link", "add", "xcidr0", "type", "veth", "peer", "name", "xcidr1"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", held, "dev", "xcidr0"], check=True)
        node = ServerProcess(tmp_path / "data", cidr)
        with pytest.raises(RuntimeError) as err:
            node.start()
        assert f"the slot CIDR {cidr} is in use on this host" in str(err.value)
        assert "AENV_SLOT_CIDR" in str(err.value)
    finally:
        subprocess.run(["ip", "link", "del", "xcidr0"], check=False)
    node = ServerProcess(tmp_path / "data2", cidr)
    node.start()
    node.kill_all()
