"""The sandbox proxy as E2B SDKs depend on it: cut streams of killed sandboxes, private
sandboxes, envd's internal routes, and streaming in both directions."""

from __future__ import annotations

import hashlib
import os
import time

import httpx

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
