"""WebSocket pass-through to a sandbox port, with a WebSocket echo server in the guest."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.framework.server import ServerProcess

# A WebSocket echo server on the guest's python3 standard library (no packages in the guest);
# how each connection ended (close code and reason, or dropped) goes to /tmp/ws-ends. "host?" is
# answered with the handshake's Host header, "bye" with a close frame without a code.
ECHO_SERVER = r'''
import base64, hashlib, socket, struct, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def read(f, n):
    b = f.read(n)
    if len(b) < n:
        raise EOFError
    return b
def handle(c):
    f = c.makefile("rb")
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += read(f, 1)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1(key + GUID).digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    try:
        while True:
            b1, b2 = read(f, 2)
            op, n = b1 & 0x0F, b2 & 0x7F
            if n == 126:
                n = struct.unpack(">H", read(f, 2))[0]
            elif n == 127:
                n = struct.unpack(">Q", read(f, 8))[0]
            mask = read(f, 4)
            data = bytes(x ^ mask[i % 4] for i, x in enumerate(read(f, n)))
            if data == b"host?":  # answers with the Host header of its handshake
                data = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"host:")][0]
                c.sendall(bytes([0x81, len(data)]) + data)
                continue
            if data == b"bye":  # closes with a close frame that has no code
                c.sendall(b"\x88\x00")
                ended("closed by the server")
                return
            if op == 8:
                ended(str(struct.unpack(">H", data[:2])[0]) + " " + data[2:].decode() if data else "no code")
                c.sendall(b"\x88\x02" + (data[:2] or b"\x03\xe8"))
                return
            out = b"echo:" + data
            n = len(out)
            size = bytes([n]) if n < 126 else (b"\x7e" + struct.pack(">H", n) if n < 65536 else b"\x7f" + struct.pack(">Q", n))
            c.sendall(bytes([0x80 | op]) + size + out)
    except (EOFError, OSError):
        ended("dropped")
    finally:
        c.close()
def ended(how):
    with open("/tmp/ws-ends", "a") as log:
        log.write(how + "\n")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8765))
s.listen()
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
'''


def test_websocket_echo_through_the_proxy_and_cut_on_kill(e2b_server: ServerProcess, api: httpx.Client) -> None:
    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"},
                       content=ECHO_SERVER.encode()).status_code == 204
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &"})
        assert r.status_code == 200, r.text
        url = e2b_server.url.replace("http://", "ws://") + "/socket"
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8765"}

        async def scenario() -> dict:
            out: dict = {}
            for _ in range(100):  # the server takes a moment to listen
                try:
                    ws = await connect(url, additional_headers=headers, max_size=None)
                    break
                except InvalidStatus:
                    await asyncio.sleep(0.2)
            async with ws:
                await ws.send("hello")
                out["text"] = await ws.recv()
                blob = os.urandom(70_000)
                await ws.send(blob)
                out["binary"] = await ws.recv() == b"echo:" + blob
                t0 = time.monotonic()
                api.delete(f"/sandboxes/{sid}")
                try:
                    await asyncio.wait_for(ws.recv(), 15)
                    out["after_kill"] = "message"
                except ConnectionClosed as e:
                    out["after_kill"] = e.rcvd.code if e.rcvd else "no close frame"
                out["cut_s"] = time.monotonic() - t0
            try:
                await connect(url, additional_headers=headers)
                out["dead"] = None
            except InvalidStatus as e:
                out["dead"] = [e.response.status_code, e.response.body]
            return out

        out = asyncio.run(scenario())
    finally:
        api.delete(f"/sandboxes/{sid}")
    assert out["text"] == "echo:hello" and out["binary"] is True
    assert out["after_kill"] == 1011 and out["cut_s"] < 5
    assert out["dead"][0] == 502 and b"The sandbox was not found" in out["dead"][1]


def test_a_websocket_reaches_the_guest_with_the_host_an_http_request_would(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """The client's Host (or the sandbox's maskRequestHost), as over HTTP: a server that checks
    Origin against Host (Jupyter, Vite) refused a handshake that named the guest's address.
    And a close frame without a code from the guest reaches the client as a normal close, not
    as a dropped connection."""
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120,
                                        "network": {"maskRequestHost": "masked.example:${PORT}"}})
    masked = r.json()["sandboxID"]
    plain = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        for sid in (masked, plain):
            assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"},
                           content=ECHO_SERVER.encode()).status_code == 204
            r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &"})
            assert r.status_code == 200, r.text
        url = e2b_server.url.replace("http://", "ws://") + "/socket"

        async def host_seen(sid: str) -> tuple[str, int | None]:
            headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8765"}
            for _ in range(100):  # the server takes a moment to listen
                try:
                    ws = await connect(url, additional_headers=headers)
                    break
                except InvalidStatus:
                    await asyncio.sleep(0.2)
            async with ws:
                await ws.send("host?")
                host = await ws.recv()
                await ws.send("bye")
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 15)
            return str(host), closed.value.rcvd.code if closed.value.rcvd else None

        assert asyncio.run(host_seen(masked)) == ("masked.example:8765", 1000)
        client_host = e2b_server.url.removeprefix("http://")
        assert asyncio.run(host_seen(plain)) == (client_host, 1000)
    finally:
        api.delete(f"/sandboxes/{masked}")
        api.delete(f"/sandboxes/{plain}")


def test_websocket_to_a_closed_port_is_502(e2b_server: ServerProcess, api: httpx.Client) -> None:
    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}).json()["sandboxID"]
    try:
        async def attempt() -> InvalidStatus:
            with pytest.raises(InvalidStatus) as e:
                await connect(e2b_server.url.replace("http://", "ws://") + "/",
                              additional_headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "9"})
            return e.value

        err = asyncio.run(attempt())
        assert err.response.status_code == 502 and b"port is not open" in err.response.body
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_websocket_to_a_server_on_the_guests_loopback(e2b_server: ServerProcess, api: httpx.Client) -> None:
    """A WebSocket server bound to 127.0.0.1 in the guest is reached through the agent's forward."""
    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        script = ECHO_SERVER.replace('("0.0.0.0", 8765)', '("127.0.0.1", 8766)')
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"}, content=script.encode()).status_code == 204
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/ws.py >/dev/null 2>&1 &"}).status_code == 200

        async def scenario() -> str:
            url = e2b_server.url.replace("http://", "ws://") + "/"
            for _ in range(100):
                try:
                    async with connect(url, additional_headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8766"}) as ws:
                        await ws.send("via loopback")
                        return str(await ws.recv())
                except InvalidStatus:
                    await asyncio.sleep(0.2)
            return "never connected"

        assert asyncio.run(scenario()) == "echo:via loopback"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_the_sandbox_sees_how_the_client_closed(e2b_server: ServerProcess, api: httpx.Client) -> None:
    """The client's close code and reason reach the sandbox's server; a close frame without a
    code stays one, and so does a client that vanishes (no close frame), not a normal close
    (1000) that never happened."""
    sid = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"},
                       content=ECHO_SERVER.encode()).status_code == 204
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/ws.py >/dev/null 2>&1 &"}).status_code == 200
        url = e2b_server.url.replace("http://", "ws://") + "/"
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8765"}

        async def scenario() -> None:
            for how in ("code", "no code", "vanish"):
                for _ in range(100):
                    try:
                        ws = await connect(url, additional_headers=headers)
                        break
                    except InvalidStatus:
                        await asyncio.sleep(0.2)
                await ws.send("hi")
                assert await ws.recv() == "echo:hi"
                if how == "code":
                    await ws.close(4001, "done here")
                elif how == "no code":
                    await ws.close(None)  # type: ignore[arg-type]
                else:
                    ws.transport.abort()
                await asyncio.sleep(0.5)

        asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ends = api.get(f"/sandboxes/{sid}/files", params={"path": "/tmp/ws-ends"})
            if ends.status_code == 200 and ends.text.count("\n") >= 3:
                break
            time.sleep(0.3)
        # uvicorn reports a lost connection as 1005, as a close frame without a code: the sandbox
        # gets that close, not a normal close (1000) nobody sent
        assert ends.text.splitlines() == ["4001 done here", "no code", "no code"], ends.text
    finally:
        api.delete(f"/sandboxes/{sid}")


# A guest WebSocket server on the standard library: answers the upgrade, sends "hello", then
# one 20 MiB binary message, then reads the close frame and hangs up.
GUEST_WS_SERVER = r'''
import base64, hashlib, socket, struct
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8081))
srv.listen()
while True:
    conn, _ = srv.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    conn.sendall(b"\x81\x05hello")
    conn.sendall(b"\x82\x7f" + struct.pack(">Q", 20 << 20) + b"x" * (20 << 20))
    try:
        conn.recv(4096)
    except OSError:
        pass
    conn.close()
'''


def test_a_guest_websocket_message_larger_than_the_bound_closes_with_1009(
        e2b_server: ServerProcess, api: httpx.Client) -> None:
    """The proxy holds a WebSocket message whole to relay it: a guest's 20 MiB message, past
    the 16 MiB bound (uvicorn's for the client's side), ends the connection with 1009 instead
    of growing the server's memory by what a program in the sandbox chooses to send."""
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"},
                       content=GUEST_WS_SERVER.encode()).status_code == 204
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "nohup python3 /tmp/ws.py >/tmp/ws.log 2>&1 &"})
        assert r.status_code == 200, r.text
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8081"}

        async def session() -> tuple[list[object], int | None]:
            got: list[object] = []
            for _ in range(100):  # the server takes a moment to listen
                try:
                    async with connect(e2b_server.url.replace("http://", "ws://") + "/", additional_headers=route,
                                          open_timeout=10, max_size=None) as ws:
                        try:
                            async for m in ws:
                                got.append(m if isinstance(m, str) else len(m))
                        except ConnectionClosed as exc:
                            return got, exc.rcvd.code if exc.rcvd else None
                        return got, ws.close_code
                except InvalidStatus:
                    await asyncio.sleep(0.2)
            raise AssertionError("the guest's WebSocket server never answered")

        got, code = asyncio.run(asyncio.wait_for(session(), 60))
        assert got == ["hello"] and code == 1009, (got, code)
    finally:
        api.delete(f"/sandboxes/{sid}")
