"""e2b 1.x (1.11), which has neither E2B_API_URL nor E2B_SANDBOX_URL: it always speaks HTTPS to
``https://api.{domain}`` and ``https://49983-{sandboxID}.{domain}``. So it runs against a node
serving TLS (AENV_TLS_CERT/KEY) on port 443 of a loopback address of this run, with a
certificate for ``{domain}`` and ``*.{domain}`` from a CA the SDK trusts (SSL_CERT_FILE), and
in a private mount namespace whose /etc/hosts plays wildcard DNS: ``api.{domain}`` is there
from the start, and the program adds its sandbox's host name once it knows the id (what a
``*.{domain}`` DNS record would answer)."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2b.conftest import PY_1X, SDK, _remove_slots_in
from tests.framework.net import TEST_NET, node_cidr
from tests.framework.server import ServerProcess

DOMAIN = "aenv1x.test"
IP = f"127.0.{TEST_NET.network_address.packed[1]}.1"


def _make_certs(d: Path) -> None:
    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=AgentENV test CA")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={DOMAIN}")
    (d / "san.ext").write_text(f"subjectAltName=DNS:{DOMAIN},DNS:*.{DOMAIN},IP:{IP}\n")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "2", "-extfile", "san.ext")


class TLSNode(ServerProcess):
    def __init__(self, data_dir: Path, cidr: str, certs: Path) -> None:
        super().__init__(data_dir, cidr, AENV_HOST=IP, AENV_PORT="443", AENV_DOMAIN=DOMAIN,
                         AENV_TLS_CERT=str(certs / "server.pem"), AENV_TLS_KEY=str(certs / "server.key"))
        self.port, self.url, self.ca = 443, f"https://{IP}", str(certs / "ca.pem")

    def start(self, timeout: float = 60.0) -> None:
        os.environ["SSL_CERT_FILE"] = self.ca  # for the health polls of ServerProcess.start
        try:
            super().start(timeout)
        finally:
            del os.environ["SSL_CERT_FILE"]

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key}, timeout=timeout,
                            verify=ssl.create_default_context(cafile=self.ca))


@pytest.fixture(scope="module")
def tls_sdk(sdk_clients: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SDK, Path]]:
    tmp = tmp_path_factory.mktemp("tls")
    _make_certs(tmp)
    hosts = tmp / "hosts"
    shutil.copy("/etc/hosts", hosts)
    with hosts.open("a") as f:
        f.write(f"{IP} api.{DOMAIN}\n")
    cidr = node_cidr(25)
    _remove_slots_in(cidr)
    node = TLSNode(tmp / "data", cidr, tmp)
    node.start()
    try:
        yield SDK(node, sdk_clients, tmp), hosts
    finally:
        node.kill_all()
        _remove_slots_in(cidr)


def test_sdk_1x_over_tls_with_host_routing(tls_sdk: tuple[SDK, Path]) -> None:
    sdk, hosts = tls_sdk
    wrap = ("unshare", "--mount", "sh", "-c", f'mount --bind "{hosts}" /etc/hosts && exec "$@"', "sh")
    out = sdk.python(PY_1X, """
        import json, os
        from e2b import Sandbox, CommandExitException
        from e2b.sandbox.sandbox_api import SandboxQuery
        sb = Sandbox(template="base", metadata={"sdk": "1.x"}, envs={"A": "from-1x"}, timeout=100)
        with open("/etc/hosts", "a") as f:  # what the *.{domain} DNS record answers
            f.write(os.environ["AENV_TEST_IP"] + " " + sb.get_host(49983) + "\\n")
        o = {"id": sb.sandbox_id, "host": sb.get_host(49983)}
        o["run"] = sb.commands.run("echo $A; id -un").stdout
        try:
            sb.commands.run("exit 5")
        except CommandExitException as e:
            o["exit"] = e.exit_code
        sb.files.write("/home/user/one.txt", "from 1.x")
        o["read"] = sb.files.read("/home/user/one.txt")
        o["list"] = [e.name for e in sb.files.list("/home/user") if e.name == "one.txt"]
        o["listed"] = [[s.sandbox_id, s.metadata] for s in Sandbox.list(query=SandboxQuery(metadata={"sdk": "1.x"}))]
        sb.set_timeout(300)
        i = sb.get_info()
        o["info"] = [i.sandbox_id, i.template_id, i.metadata, (i.end_at - i.started_at).total_seconds()]
        o["running"] = sb.is_running()
        o["kill"] = Sandbox.kill(sb.sandbox_id)  # 1.11's instance kill() returns None whatever happens
        o["running_after"] = sb.is_running()
        o["kill_again"] = Sandbox.kill(sb.sandbox_id)
        print(json.dumps(o))
    """, wrap=wrap, SSL_CERT_FILE=str(hosts.parent / "ca.pem"), E2B_DOMAIN=DOMAIN, AENV_TEST_IP=IP)
    sid = out["id"]
    assert out["host"] == f"49983-{sid}.{DOMAIN}"
    assert out["run"] == "from-1x\nuser\n" and out["exit"] == 5
    assert out["read"] == "from 1.x" and out["list"] == ["one.txt"]
    assert out["listed"] == [[sid, {"sdk": "1.x"}]]
    assert out["info"][:3] == [sid, "base", {"sdk": "1.x"}] and out["info"][3] > 290
    assert (out["running"], out["kill"], out["running_after"], out["kill_again"]) == (True, True, False, False)
