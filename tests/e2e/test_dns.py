"""Guests resolve names through the host's DNS forwarder (network/dns.py), the one host
service a sandbox reaches. The upstream here is a real dnsmasq on the host's loopback, which
a guest could never reach itself (loopback and private ranges are always denied)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import run
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess

NAME, ADDRESS = "aenv-dns-test.example", "198.51.100.7"

# A DNS query over TCP from the guest, in the guest's Python (no dig in the image).
TCP_QUERY = r'''
import socket, struct, sys
q = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in sys.argv[1].split(".")) + b"\0" + struct.pack(">HH", 1, 1)
s = socket.create_connection(("169.254.0.22", 53), timeout=5)
s.sendall(struct.pack(">H", len(q)) + q)
n = struct.unpack(">H", s.recv(2))[0]
a = b""
while len(a) < n:
    a += s.recv(n - len(a))
print(".".join(map(str, a[-4:])) if a[:2] == b"\x42\x42" else "bad id")
'''


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    dnsmasq = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([dnsmasq, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                             "--bind-interfaces", "--listen-address=127.0.0.1", f"--port={port}",
                             f"--address=/{NAME}/{ADDRESS}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
    yield port
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, upstream: int) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path_factory.mktemp("dns") / "data", node_cidr(42), AENV_DNS_UPSTREAM=f"127.0.0.1:{upstream}")
    s.start()
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def api(node: ServerProcess) -> Iterator[httpx.Client]:
    with node.client() as c:
        yield c


def test_a_guest_resolves_names_over_udp_and_tcp_through_the_forwarder(api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    try:
        assert run(api, sid, "cat /etc/resolv.conf")["stdout"] == "nameserver 169.254.0.22\n"
        out = run(api, sid, f"getent hosts {NAME}")
        assert out["exitCode"] == 0 and out["stdout"].split()[0] == ADDRESS, out
        out = run(api, sid, ["python3", "-c", TCP_QUERY, NAME])
        assert out["stdout"].strip() == ADDRESS, out
        assert run(api, sid, "getent hosts no-such-name.invalid")["exitCode"] != 0
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_the_forwarder_opens_port_53_and_nothing_else(api: httpx.Client, node: ServerProcess) -> None:
    """The forwarder's address is the host's: its API port there stays closed to guests, and a
    sandbox without internet access still resolves names (the forwarder is not the internet)."""
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))  # a host service on every address, the forwarder's among them
    listener.listen()
    sid = api.post("/sandboxes", json={"templateID": "base", "allow_internet_access": False}).json()["sandboxID"]
    try:
        dns_addr = node_cidr(42).split("/")[0].rsplit(".", 1)[0] + ".1"
        port = listener.getsockname()[1]
        probe = (f"python3 -c \"import socket; socket.create_connection(('{dns_addr}', {port}), timeout=3)\" "
                 "2>/dev/null && echo open || echo blocked")
        assert run(api, sid, probe)["stdout"].strip() == "blocked"
        out = run(api, sid, f"getent hosts {NAME}")
        assert out["exitCode"] == 0 and out["stdout"].split()[0] == ADDRESS, out
    finally:
        api.delete(f"/sandboxes/{sid}")
        listener.close()


# A DNS query over UDP; prints the answer's address, or "no answer" after 3 s.
UDP_QUERY = r'''
import socket, struct, sys
q = struct.pack(">HHHHHH", 0x4343, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in sys.argv[2].split(".")) + b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
s.sendto(q, (sys.argv[1], 53))
try:
    a = s.recv(512)
    print(".".join(map(str, a[-4:])))
except socket.timeout:
    print("no answer")
'''


def test_the_forwarder_answers_the_host_but_not_a_neighbour_on_another_interface(node: ServerProcess) -> None:
    """The kernel takes the forwarder's address (on loopback) from any interface: a LAN
    neighbour or a container of the host could relay queries through it into the host's
    resolvers. Here the neighbour is a namespace behind its own veth pair, routed to it."""
    dns_addr = node_cidr(42).split("/")[0].rsplit(".", 1)[0] + ".1"
    ns, host_if, ns_if = "aenv-t-lan", "tlanh0", "tlann0"
    sh = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns)
        sh("ip", "addr", "add", "198.18.77.1/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", ns, "addr", "add", "198.18.77.2/30", "dev", ns_if)
        sh("ip", "-n", ns, "link", "set", ns_if, "up")
        sh("ip", "-n", ns, "route", "add", dns_addr, "via", "198.18.77.1")
        on_host = subprocess.run(["python3", "-c", UDP_QUERY, dns_addr, NAME], capture_output=True, text=True,
                                 timeout=30)
        assert on_host.stdout.strip() == ADDRESS, on_host  # the forwarder is up and answers the host
        neighbour = subprocess.run(["ip", "netns", "exec", ns, "python3", "-c", UDP_QUERY, dns_addr, NAME],
                                   capture_output=True, text=True, timeout=30)
        assert neighbour.stdout.strip() == "no answer", neighbour
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
