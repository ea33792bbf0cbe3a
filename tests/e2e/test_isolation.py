"""Each sandbox has its own network namespace; sandboxes reach neither each other nor the host."""

from __future__ import annotations

import socket
import subprocess
import threading

import httpx

from tests.e2e.conftest import ns_addr, run
from tests.framework.server import ServerProcess


def test_sandboxes_are_isolated_from_each_other_and_the_host(api: httpx.Client, server: ServerProcess) -> None:
    a = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    b = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    accepted: list[object] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
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
