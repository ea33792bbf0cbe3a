"""Each sandbox has its own network namespace; sandboxes reach neither each other nor the host."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ns_addr, run
from tests.framework.net import TEST_NET, node_cidr
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


def test_a_port_the_host_publishes_by_dnat_is_no_way_out(api: httpx.Client, server: ServerProcess) -> None:
    """``docker run -p``, a Kubernetes NodePort: the host rewrites connections to one of its
    ports into connections to a container. A guest must not get through such a port to a
    service it may not reach directly (here one on a private address, in a namespace of its
    own behind the host, as a container is)."""
    n = TEST_NET.network_address.packed[1]
    net = next(ipaddress.ip_network(node_cidr(49)).subnets(new_prefix=30))
    host_end, svc_ip = str(net[1]), str(net[2])
    ns, veth, table = f"aenv-test-svc{n}", f"tsvc{n}", f"aenvtest_dnat{n}"
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]

    def sh(*argv: str, check: bool = True) -> None:
        subprocess.run(argv, check=check, capture_output=True)

    def clean() -> None:
        sh("nft", "delete", "table", "ip", table, check=False)
        sh("ip", "link", "del", veth, check=False)
        sh("ip", "netns", "del", ns, check=False)

    clean()
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    service = None
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "svc0", "netns", ns)
        sh("ip", "addr", "add", f"{host_end}/30", "dev", veth)
        sh("ip", "link", "set", veth, "up")
        for cmd in (["addr", "add", f"{svc_ip}/30", "dev", "svc0"], ["link", "set", "svc0", "up"],
                    ["link", "set", "lo", "up"], ["route", "add", "default", "via", host_end]):
            sh("ip", "-n", ns, *cmd)
        service = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "http.server", "8080",
                                    "--bind", svc_ip, "--directory", "/etc"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{svc_ip}:8080/hostname", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the service did not start")
        rules = (f"table ip {table} {{\n chain pre {{\n type nat hook prerouting priority dstnat; policy accept;\n"
                 f" ip daddr {host_ip} tcp dport 18080 dnat to {svc_ip}:8080\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True, capture_output=True)
        r = run(api, sid, f"curl -s -m 3 -o /dev/null -w '%{{http_code}}' http://{host_ip}:18080/hostname; "
                          f"echo ' rc='$?")
        assert "200" not in r["stdout"] and "rc=0" not in r["stdout"], r
    finally:
        if service is not None:
            service.kill()
            service.wait()
        clean()
        api.delete(f"/sandboxes/{sid}")


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
