"""Egress policy (allow_internet_access, network.allowOut/denyOut, PUT .../network) enforced
in each sandbox's namespace, with real guests.

There is no internet here, so "outside" is a network namespace of its own reached through the
host's routing like any internet address: a veth pair 198.18.N.1 (host) ↔ 198.18.N.2 (outside;
an HTTP server listens there), N taken from AENV_TEST_NET so concurrent runs do not collide.
198.18.0.0/15 is not among the always-denied ranges, so a default sandbox reaches it. A second
HTTP server listens on the host's own end, 198.18.N.1: the host must stay unreachable even when
an allow rule names it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.e2b.conftest import PY_LATEST, SDK
from tests.framework.net import TEST_NET, wait_for_http

N = TEST_NET.network_address.packed[1]
HOST_IP, OUTSIDE_IP = f"198.18.{N}.1", f"198.18.{N}.2"
NS, HOST_IF = f"e2bt-{N}", f"e2bt{N}h"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@pytest.fixture(scope="module")
def outside() -> Iterator[None]:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, check=False)
    _sh("ip", "netns", "add", NS)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", "e2bt-in", "netns", NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh("ip", "-n", NS, "addr", "add", f"{OUTSIDE_IP}/30", "dev", "e2bt-in")
        _sh("ip", "-n", NS, "link", "set", "e2bt-in", "up")
        _sh("ip", "-n", NS, "link", "set", "lo", "up")
        server = [sys.executable, "-m", "http.server", "8080", "--directory", "/etc"]
        procs.append(subprocess.Popen(["ip", "netns", "exec", NS, *server, "--bind", OUTSIDE_IP],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen([*server, "--bind", HOST_IP], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        for proc, ip in zip(procs, (OUTSIDE_IP, HOST_IP)):
            wait_for_http(proc, f"http://{ip}:8080/hostname")
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, check=False)


PROBE = f'''
import json
from e2b import Sandbox, SandboxException
def probe(sb, ip):
    cmd = ("python3 -c \\"import urllib.request; "
           f"print(urllib.request.urlopen('http://{{ip}}:8080/hostname', timeout=3).status)\\" 2>/dev/null || echo blocked")
    return sb.commands.run(cmd, timeout=30).stdout.strip()
OUT, HOST = "{OUTSIDE_IP}", "{HOST_IP}"
o = {{}}
'''


def test_egress_rules_decide_what_a_guest_reaches(sdk: SDK, outside: None) -> None:
    out = sdk.python(PY_LATEST, PROBE + """
sb = Sandbox.create(timeout=120)
o["default"] = [probe(sb, OUT), probe(sb, HOST)]
sb.update_network({"deny_out": [OUT[:OUT.rindex(".")] + ".0/24"]})
o["updated_deny"] = probe(sb, OUT)
o["updated_info"] = sb.get_info().network
sb.update_network({})  # full replacement: omitted lists are cleared
o["updated_clear"] = probe(sb, OUT)
sb.kill()

sb = Sandbox.create(timeout=120, allow_internet_access=False)
o["no_internet"] = [probe(sb, OUT), sb.get_info().allow_internet_access]
sb.update_network({"allow_out": [OUT], "deny_out": ["0.0.0.0/0"]})
o["no_internet_then_allowed"] = probe(sb, OUT)
sb.update_network({})  # everything allowed again: the detail must say so, not its create-time False
o["no_internet_then_open"] = [probe(sb, OUT), sb.get_info().allow_internet_access]
sb.kill()

sb = Sandbox.create(timeout=120, allow_internet_access=False, network={"allow_out": [OUT, HOST]})
o["allow_listed"] = [probe(sb, OUT), probe(sb, HOST)]
sb.kill()

sb = Sandbox.create(timeout=120, network={"deny_out": [OUT + "/32"]})
o["deny_listed"] = probe(sb, OUT)
sb.kill()
print(json.dumps(o))
""")
    assert out["default"] == ["200", "blocked"]
    assert out["updated_deny"] == "blocked"
    assert out["no_internet_then_open"] == ["200", True]
    assert out["updated_info"] == {"deny_out": [f"198.18.{N}.0/24"]}
    assert out["updated_clear"] == "200"
    assert out["no_internet"] == ["blocked", False]
    assert out["no_internet_then_allowed"] == "200"
    assert out["allow_listed"] == ["200", "blocked"]  # the host stays denied whatever the rules say
    assert out["deny_listed"] == "blocked"


def test_egress_lists_take_addresses_not_domain_names(sdk: SDK, api: httpx.Client) -> None:
    out = sdk.python(PY_LATEST, """
        import json
        from e2b import Sandbox, SandboxException
        o = {}
        for net in ({"allow_out": ["example.com"]}, {"deny_out": ["*.example.com"]}, {"deny_out": ["300.1.2.3"]}):
            try:
                Sandbox.create(timeout=60, network=net)
                o.setdefault("errors", []).append(None)
            except SandboxException as e:
                o.setdefault("errors", []).append(str(e))
        print(json.dumps(o))
    """)
    e1, e2, e3 = out["errors"]
    assert e1.startswith("400: network.allowOut: 'example.com' is a domain name")
    assert e2.startswith("400: network.denyOut: '*.example.com' is a domain name")
    assert e3.startswith("400: network.denyOut: '300.1.2.3' is not an IPv4 address or CIDR block")

    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()["sandboxID"]
    try:
        r = api.put(f"/sandboxes/{sid}/network", json={"allowOut": ["example.com"]})
        assert r.status_code == 400 and r.json()["code"] == 400 and "domain name" in r.json()["message"]
        r = api.put(f"/sandboxes/{sid}/network", json={"egressProxy": {"address": "1.2.3.4:8080"}})
        assert r.status_code == 400 and "egressProxy" in r.json()["message"]
    finally:
        api.delete(f"/sandboxes/{sid}")
    r = api.put(f"/sandboxes/{sid}/network", json={"denyOut": ["0.0.0.0/0"]})
    assert r.status_code == 404 and r.json() == {"code": 404, "message": f"sandbox '{sid}' not found"}


RECEIVER = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
s.settimeout(4)
got = []
print("ready", flush=True)
try:
    while True:
        data, src = s.recvfrom(100)
        got.append([data.decode(), src[0]])
except TimeoutError:
    pass
print(json.dumps(got), flush=True)
"""

SENDER = """
import socket, sys
for src in ("169.254.0.21", sys.argv[1]):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((src, 0))
    s.sendto(src.encode(), (sys.argv[2], 9999))
    s.close()
"""


def test_a_guest_cannot_send_with_a_forged_source_address(api: httpx.Client, outside: None) -> None:
    """Root in a guest gives itself another address and sends from it: the packet must not
    leave its namespace (spoofed traffic from this host, or another sandbox's address used to
    open a path to it). The same datagram from the guest's own address arrives, masqueraded."""
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    receiver = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", RECEIVER, OUTSIDE_IP],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        forged = "192.0.2.77"
        for cmd in (["ip", "addr", "add", f"{forged}/32", "dev", "eth0"],
                    ["python3", "-c", SENDER, forged, OUTSIDE_IP]):
            r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd, "user": "root"})
            assert r.status_code == 200 and r.json()["exitCode"] == 0, r.text
        out, _ = receiver.communicate(timeout=30)
        got = json.loads(out.strip().splitlines()[-1])
        assert [data for data, _src in got] == ["169.254.0.21"], got
        assert got[0][1] == HOST_IP, "masqueraded to the host's address on that route"
    finally:
        receiver.kill()
        api.delete(f"/sandboxes/{sid}")
