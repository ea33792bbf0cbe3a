"""The sandbox proxy as E2B SDKs depend on it: cut streams of killed sandboxes, private
sandboxes, envd's internal routes, and streaming in both directions."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from tests.e2b.conftest import PY_LATEST, SDK
from tests.framework.server import ServerProcess


def test_a_command_streaming_when_its_sandbox_is_killed_ends_with_not_running(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json, threading, time
        from e2b import Sandbox, SandboxNotRunningException
        sb = Sandbox.create(timeout=120)
        h = sb.commands.run("echo started; sleep 300", background=True)
        o = {}
        killer = threading.Timer(2.0, lambda: Sandbox.kill(sb.sandbox_id))
        killer.start()
        t0 = time.monotonic()
        try:
            h.wait()
            o["error"] = None
        except Exception as e:
            o["error"] = type(e).__name__
            o["not_running"] = isinstance(e, SandboxNotRunningException)
        o["elapsed"] = time.monotonic() - t0
        killer.join()  # the launcher leaves with os._exit: the kill must be answered first
        print(json.dumps(o))
    """)
    assert out["error"] == "SandboxNotRunningException" and out["not_running"] is True
    assert out["elapsed"] < 15


def test_private_sandbox_ports_need_the_traffic_token(e2b_server: ServerProcess, api: httpx.Client) -> None:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120,
                                        "network": {"allowPublicTraffic": False, "maskRequestHost": "masked:${PORT}"}})
    assert r.status_code == 201, r.text
    sb = r.json()
    sid, token, envd_token = sb["sandboxID"], sb["trafficAccessToken"], sb["envdAccessToken"]
    assert token and envd_token and token != envd_token
    try:
        # A server in the guest that answers with the Host header it was sent.
        script = ("import http.server as h\n"
                  "class H(h.BaseHTTPRequestHandler):\n"
                  "    def do_GET(s):\n"
                  "        b = s.headers['Host'].encode(); s.send_response(200); s.send_header('Content-Length', str(len(b)))\n"
                  "        s.end_headers(); s.wfile.write(b)\n"
                  "h.HTTPServer(('0.0.0.0', 8000), H).serve_forever()\n")
        r = api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/echo_host.py"}, content=script.encode())
        assert r.status_code == 204, r.text
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/echo_host.py >/dev/null 2>&1 &"})
        assert r.status_code == 200, r.text
        url, host = e2b_server.url + "/", f"8000-{sid}.aenv.test"
        r = httpx.get(url, headers={"Host": host})
        assert r.status_code == 403 and "traffic access token" in r.json()["message"]
        r = httpx.get(url, headers={"Host": host, "e2b-traffic-access-token": "wrong"})
        assert r.status_code == 403
        for _ in range(100):
            r = httpx.get(url, headers={"Host": host, "e2b-traffic-access-token": token})
            if r.status_code == 200:
                break
            time.sleep(0.2)
        assert (r.status_code, r.text) == (200, "masked:8000")
        # The envd port is exempt from the traffic token (envd checks its own access token).
        r = httpx.get(e2b_server.url + "/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
        assert r.status_code in (200, 204)
        r = httpx.post(e2b_server.url + "/process.Process/List", json={},
                       headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 401  # no X-Access-Token: envd refuses
        r = httpx.post(e2b_server.url + "/process.Process/List", json={},
                       headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": envd_token})
        assert r.status_code == 200 and isinstance(r.json(), dict)  # the (possibly empty) process list
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_request_without_the_traffic_token_does_not_wake_a_private_sandbox(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "autoPause": True,
                                        "autoResume": {"enabled": True},
                                        "network": {"allowPublicTraffic": False}})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["trafficAccessToken"]
    try:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        url, host = e2b_server.url + "/", f"8000-{sid}.aenv.test"
        for sent in ({}, {"e2b-traffic-access-token": "wrong"}):
            r = httpx.get(url, headers={"Host": host, **sent})
            assert r.status_code == 403, r.text
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"  # not woken by a stranger
        r = httpx.get(url, headers={"Host": host, "e2b-traffic-access-token": token}, timeout=60)
        assert r.status_code == 502 and "port" in r.text.lower()  # woken; nothing listens on 8000
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_request_without_envd_credentials_does_not_wake_a_sandbox(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """The agent's port needs no traffic token (the agent checks its own access token), but a
    paused auto-resume sandbox is woken only by a request the agent would accept: its token,
    or a pre-signed /files URL (E2B's download_url/upload_url) whose signature is right."""
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "autoPause": True,
                                        "autoResume": {"enabled": True}})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}

    def signed(path: str, secret: str) -> dict[str, str]:
        raw = f"{path}:read:user:{secret}"
        sig = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")
        return {"path": path, "username": "user", "signature": sig}

    try:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        strangers = [("GET", "/health", {}, {}), ("POST", "/process.Process/List", {}, {"X-Access-Token": "wrong"}),
                     ("GET", "/files", signed("/etc/hostname", "wrong"), {}),
                     ("GET", "/files", {"path": "/etc/hostname", "username": "user"}, {})]
        for method, path, params, headers in strangers:
            r = httpx.request(method, e2b_server.url + path, params=params, headers={**envd, **headers},
                              json={} if method == "POST" else None)
            assert r.status_code == 502, (path, r.text)
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"  # not woken by a stranger
        r = httpx.get(e2b_server.url + "/files", params=signed("/etc/hostname", token), headers=envd, timeout=60)
        assert r.status_code == 200 and r.text.strip(), r.text  # a pre-signed URL wakes it
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        r = httpx.post(e2b_server.url + "/process.Process/List", json={}, headers={**envd, "X-Access-Token": token},
                       timeout=60)
        assert r.status_code == 200, r.text  # so does the agent's token
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_request_target_reaches_the_guest_as_the_client_sent_it(e2b_server: ServerProcess,
                                                                  api: httpx.Client) -> None:
    """The guest's server gets the path and query the client sent: httpx's URL normalised them
    on the way (``/a/../b`` became ``/b``, ``{`` became ``%7B``), which E2B's proxy does not."""
    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        serve = ("import http.server as h\n"
                 "class H(h.BaseHTTPRequestHandler):\n"
                 "    def do_GET(s):\n"
                 "        b = s.path.encode(); s.send_response(200); s.send_header('Content-Length', str(len(b)))\n"
                 "        s.end_headers(); s.wfile.write(b)\n"
                 "h.HTTPServer(('0.0.0.0', 8083), H).serve_forever()\n")
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/echo_path.py"},
                       content=serve.encode()).status_code == 204
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/echo_path.py >/dev/null 2>&1 &"})
        assert r.status_code == 200, r.text
        port = int(e2b_server.url.rsplit(":", 1)[1])
        target = b"/a/../b/%2F/{x}?q={y}&z=%41"
        for _ in range(100):  # the server takes a moment to listen
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: " + sid.encode()
                          + b"\r\nE2b-Sandbox-Port: 8083\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := c.recv(65536):
                    answer += chunk
            if answer.startswith(b"HTTP/1.1 200"):
                break
            time.sleep(0.2)
        assert answer.split(b"\r\n\r\n", 1)[1] == target, answer
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_proxy_routing_errors(e2b_server: ServerProcess) -> None:
    u = e2b_server.url
    r = httpx.get(u + "/health", headers={"E2b-Sandbox-Id": "inosuchsandbox", "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502
    assert r.json() == {"sandboxId": "inosuchsandbox", "message": "The sandbox was not found", "code": 502}
    r = httpx.get(u + "/health", headers={"E2b-Sandbox-Id": "inosuchsandbox"})
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.get(u + "/health", headers={"E2b-Sandbox-Id": "Bad-Id", "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 400
    r = httpx.get(u + "/health", headers={"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "http"})
    assert r.status_code == 400
    assert httpx.get(u + "/health").status_code == 204  # no sandbox headers: the API


def test_a_request_dialing_a_closed_port_when_its_sandbox_is_killed_gets_not_found(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """The proxy retries a port that refuses (a server may be starting) for about a second;
    a sandbox killed meanwhile answers E2B's not-found 502, not a 500 from its closed client."""
    for delay in (0.1, 0.3, 0.5):
        sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()["sandboxID"]
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.get, e2b_server.url + "/", timeout=30,
                                  headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "9"})
            time.sleep(delay)
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
            r = pending.result()
        assert r.status_code == 502, (delay, r.status_code, r.text)
        assert r.json()["message"] in ("The sandbox was not found", "The sandbox is running but port is not open"), r.text


def test_streamed_upload_and_download_through_the_proxy(e2b_server: ServerProcess, api: httpx.Client) -> None:
    """A chunked upload of unknown length and a download, 32 MiB each way, byte-exact."""
    sb = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300}).json()
    sid = sb["sandboxID"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": sb["envdAccessToken"]}
    block = os.urandom(1024 * 1024)
    digest = hashlib.sha256(block * 32).hexdigest()

    def chunks():  # no Content-Length: sent chunked, streamed by the proxy
        for _ in range(32):
            yield block

    try:
        with httpx.Client(base_url=e2b_server.url, headers=headers, timeout=300) as c:
            r = c.post("/files", params={"path": "/home/user/up.bin"}, content=chunks(),
                       headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 200, r.text
            h, n = hashlib.sha256(), 0
            with c.stream("GET", "/files", params={"path": "/home/user/up.bin"}) as resp:
                assert resp.status_code == 200
                for part in resp.iter_bytes():  # decoded: envd may gzip (Accept-Encoding)
                    h.update(part)
                    n += len(part)
            assert (n, h.hexdigest()) == (32 * 1024 * 1024, digest)
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_the_proxy_forwards_the_clients_headers_and_no_others(e2b_server: ServerProcess, api: httpx.Client) -> None:
    """A client that sent no Accept-Encoding gets the file as it is, not gzip the proxy asked for."""
    sb = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()
    sid = sb["sandboxID"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": sb["envdAccessToken"]}
    text = b"a very compressible line\n" * 40000
    try:
        with httpx.Client(base_url=e2b_server.url, headers=headers, timeout=120) as c:
            r = c.post("/files", params={"path": "/home/user/t.txt"}, content=text,
                       headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 200, r.text
            del c.headers["accept-encoding"]  # httpx's own default
            r = c.get("/files", params={"path": "/home/user/t.txt"})
            assert r.status_code == 200 and "content-encoding" not in r.headers
            assert int(r.headers["content-length"]) == len(text) and r.content == text
            r = c.get("/files", params={"path": "/home/user/t.txt"}, headers={"Accept-Encoding": "gzip"})
            assert r.headers["content-encoding"] == "gzip" and r.content == text
    finally:
        api.delete(f"/sandboxes/{sid}")


# A guest HTTP server on python3's standard library: /headers answers with the request's
# headers; /304 with a 304 that carries a Content-Length (RFC 9110 allows it); a WebSocket
# upgrade with a redirect to the host's loopback (port in /tmp/redirect-port).
GUEST_SERVER = r'''
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
LOCAL = int(open("/tmp/redirect-port").read())
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            self.send_response(302)
            self.send_header("Location", "ws://127.0.0.1:%d/host-only" % LOCAL)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/304"):
            self.send_response(304)
            self.send_header("ETag", '"v1"')
            self.send_header("Content-Length", "10")
            self.end_headers()
            return
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
'''


def test_the_proxy_keeps_the_platforms_secrets_and_answers_what_the_guest_cannot_mislead(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """What a guest's server sees and can do through the proxy: not the node's API key, the
    traffic token or headers its client marked hop-by-hop; a 304 with a Content-Length does not
    break the client's connection; a WebSocket upgrade answered with a redirect to the host's
    loopback is refused, not followed by the server; a request target of ``*`` is a 400; the
    response's Date and Server headers are not doubled."""
    host_hits: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    sb = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120,
                                         "network": {"allowPublicTraffic": False}}).json()
    sid, token = sb["sandboxID"], sb["trafficAccessToken"]
    try:
        for path, data in (("/tmp/srv.py", GUEST_SERVER.encode()),
                           ("/tmp/redirect-port", str(listener.getsockname()[1]).encode())):
            assert api.put(f"/sandboxes/{sid}/files", params={"path": path}, content=data).status_code == 204
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/srv.py >/tmp/srv.log 2>&1 &"})
        assert r.status_code == 200, r.text
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080", "e2b-traffic-access-token": token}
        with httpx.Client(base_url=e2b_server.url, timeout=30) as c:
            for _ in range(100):  # the server takes a moment to listen
                r = c.get("/headers", headers=route)
                if r.status_code == 200:
                    break
                time.sleep(0.2)
            r = c.get("/headers", headers={**route, "X-API-Key": e2b_server.api_key, "X-Private": "p",
                                           "X-Kept": "k", "Connection": "keep-alive, X-Private"})
            seen = r.json()
            assert seen["x-kept"] == "k"
            # one Date (the proxy's server adds its own), and the Server the guest's app named
            assert len(r.headers.get_list("date")) == 1, r.headers
            assert [v.split("/")[0] for v in r.headers.get_list("server")] == ["BaseHTTP"], r.headers
            assert not {"x-api-key", "e2b-traffic-access-token", "x-private"} & set(seen), seen
            first = c.get("/304", headers=route)
            second = c.get("/headers", headers=route)  # on the same kept-alive connection
            assert first.status_code == 304 and "content-length" not in first.headers
            assert second.status_code == 200
        with socket.create_connection(("127.0.0.1", int(e2b_server.url.rsplit(":", 1)[1]))) as s:
            s.sendall(b"OPTIONS * HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: " + sid.encode() +
                      b"\r\nE2b-Sandbox-Port: 8080\r\ne2b-traffic-access-token: " + token.encode() + b"\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 400"), "a target that is not a path"

        async def upgrade() -> int:
            try:
                async with ws_connect(e2b_server.url.replace("http://", "ws://") + "/ws",
                                      additional_headers=route, open_timeout=10):
                    return 101
            except InvalidStatus as exc:
                return exc.response.status_code

        status = asyncio.run(upgrade())
        try:
            host_hits.append(listener.accept()[0].recv(4096))
        except (TimeoutError, OSError):
            pass
        assert status == 302 and host_hits == [], (status, host_hits)
    finally:
        listener.close()
        api.delete(f"/sandboxes/{sid}")


def _server_connections_to(server: ServerProcess, port: int) -> list[str]:
    """The server's established TCP connections to ``port`` (of any sandbox)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"( dport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if f"pid={server.proc.pid}," in line]


def test_the_proxys_connections_to_a_killed_sandbox_are_closed_without_more_traffic(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """A kept-alive connection to a user port of a sandbox that is gone is never closed by its
    peer: the proxy closes it, also when no request comes for another sandbox afterwards."""
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        serve = ("from http.server import SimpleHTTPRequestHandler as H, ThreadingHTTPServer as S; "
                 "H.protocol_version = 'HTTP/1.1'; S(('0.0.0.0', 8082), H).serve_forever()")  # keep-alive
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": f'nohup python3 -c "{serve}" >/dev/null 2>&1 &'})
        assert r.status_code == 200, r.text
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8082"}
        with httpx.Client(base_url=e2b_server.url, timeout=30) as c:
            for _ in range(100):  # the server takes a moment to listen
                if c.get("/", headers=route).status_code == 200:
                    break
                time.sleep(0.2)
        assert _server_connections_to(e2b_server, 8082), "the proxy keeps its connection alive"
    finally:
        api.delete(f"/sandboxes/{sid}")
    deadline = time.monotonic() + 15
    while _server_connections_to(e2b_server, 8082) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _server_connections_to(e2b_server, 8082) == []


def test_concurrent_requests_to_an_auto_resuming_sandbox_all_get_through(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """A page's several requests (or an RL worker's parallel tool calls) reach a paused sandbox
    with autoResume together: the first resumes it, the others wait for that resume instead of
    a 502 "not found" while it runs."""
    sb = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "autoPause": True,
                                         "autoResume": {"enabled": True}}).json()
    sid = sb["sandboxID"]
    try:
        for path, data in (("/tmp/srv.py", GUEST_SERVER.encode()), ("/tmp/redirect-port", b"9")):
            assert api.put(f"/sandboxes/{sid}/files", params={"path": path}, content=data).status_code == 204
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/srv.py >/dev/null 2>&1 &"}
                        ).status_code == 200
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080"}
        for _ in range(100):
            if httpx.get(e2b_server.url + "/headers", headers=route).status_code == 200:
                break
            time.sleep(0.2)
        for _ in range(3):
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
            barrier = threading.Barrier(6)

            def one(_i: int) -> int:
                barrier.wait()
                return httpx.get(e2b_server.url + "/headers", headers=route, timeout=60).status_code

            with ThreadPoolExecutor(6) as ex:
                assert list(ex.map(one, range(6))) == [200] * 6
            assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        api.delete(f"/sandboxes/{sid}")
