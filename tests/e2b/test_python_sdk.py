"""The current Python SDK (e2b 2.63, from PyPI), sync and async, against a real server."""

from __future__ import annotations

from tests.e2b.conftest import PY_LATEST, SDK


def test_create_commands_and_files_sync(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json
        from e2b import Sandbox, CommandExitException, NotFoundException
        sb = Sandbox.create(metadata={"suite": "sync", "who": "a b&c"}, envs={"GREETING": "hi there"}, timeout=180)
        o = {"id": sb.sandbox_id}
        r = sb.commands.run("echo $GREETING; id -un; pwd")
        o["run"] = [r.exit_code, r.stdout, r.stderr]
        r = sb.commands.run("echo $X >&2; id -un; pwd", envs={"X": "from-run"}, user="root", cwd="/tmp")
        o["run_root"] = [r.stdout, r.stderr]
        try:
            sb.commands.run("echo nope; exit 3")
            o["exit3"] = None
        except CommandExitException as e:
            o["exit3"] = [e.exit_code, e.stdout]
        sb.files.make_dir("/home/user/d/sub")
        info = sb.files.write("/home/user/d/a.txt", "alpha\\n")
        o["write_path"] = info.path
        sb.files.write_files([{"path": "/home/user/d/b.bin", "data": b"\\x00\\x01\\x02"},
                              {"path": "/home/user/d/sub/c.txt", "data": "gamma"}])
        o["read"] = sb.files.read("/home/user/d/a.txt")
        o["read_bytes"] = list(sb.files.read("/home/user/d/b.bin", format="bytes"))
        o["list"] = sorted((e.name, e.type.value) for e in sb.files.list("/home/user/d"))
        o["list_depth2"] = sorted(e.path for e in sb.files.list("/home/user/d", depth=2))
        sb.files.rename("/home/user/d/a.txt", "/home/user/d/renamed.txt")
        o["exists_old"] = sb.files.exists("/home/user/d/a.txt")
        o["exists_new"] = sb.files.exists("/home/user/d/renamed.txt")
        gi = sb.files.get_info("/home/user/d/renamed.txt")
        o["info"] = [gi.name, gi.type.value, gi.size, gi.owner, gi.permissions]
        sb.files.remove("/home/user/d/sub")
        o["exists_removed"] = sb.files.exists("/home/user/d/sub/c.txt")
        try:
            sb.files.read("/home/user/nope.txt")
            o["missing"] = None
        except NotFoundException as e:
            o["missing"] = "NotFoundException"
        i = sb.get_info()
        o["info_sb"] = [i.sandbox_id, i.template_id, i.metadata, i.state.value, i.cpu_count, i.memory_mb,
                        (i.end_at - i.started_at).total_seconds()]
        o["running"] = sb.is_running()
        o["killed"] = sb.kill()
        o["running_after"] = sb.is_running()
        o["kill_again"] = Sandbox.kill(sb.sandbox_id)
        print(json.dumps(o))
    """)
    assert out["run"] == [0, "hi there\nuser\n/home/user\n", ""]
    assert out["run_root"] == ["root\n/tmp\n", "from-run\n"]
    assert out["exit3"] == [3, "nope\n"]
    assert out["write_path"] == "/home/user/d/a.txt"
    assert out["read"] == "alpha\n"
    assert out["read_bytes"] == [0, 1, 2]
    assert out["list"] == [["a.txt", "file"], ["b.bin", "file"], ["sub", "dir"]]
    assert "/home/user/d/sub/c.txt" in out["list_depth2"]
    assert (out["exists_old"], out["exists_new"], out["exists_removed"]) == (False, True, False)
    assert out["info"] == ["renamed.txt", "file", 6, "user", "-rw-r--r--"]
    assert out["missing"] == "NotFoundException"
    sid, template, metadata, state, cpus, mem, lifetime = out["info_sb"]
    assert (sid, template, metadata, state, cpus, mem) == (out["id"], "base", {"suite": "sync", "who": "a b&c"},
                                                          "running", 1, 512)
    assert abs(lifetime - 180) < 2
    assert (out["running"], out["killed"], out["running_after"], out["kill_again"]) == (True, True, False, False)


def test_background_streaming_and_stdin(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json, time
        from e2b import Sandbox
        sb = Sandbox.create(timeout=120)
        o = {}
        chunks = []
        r = sb.commands.run("for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.2; done",
                            on_stdout=lambda d: chunks.append(("out", d)), on_stderr=lambda d: chunks.append(("err", d)))
        o["callbacks"] = ["".join(d for k, d in chunks if k == "out"), "".join(d for k, d in chunks if k == "err")]
        o["result"] = [r.stdout, r.stderr]
        h = sb.commands.run("sleep 0.5; echo done-bg", background=True)
        o["listed"] = h.pid in [p.pid for p in sb.commands.list()]
        res = h.wait()
        o["bg"] = [res.exit_code, res.stdout]
        h = sb.commands.run("sleep 600", background=True)
        o["kill_bg"] = sb.commands.kill(h.pid)
        for _ in range(50):  # the kill is a signal: the process leaves the list once it is reaped
            o["listed_after_kill"] = h.pid in [p.pid for p in sb.commands.list()]
            if not o["listed_after_kill"]:
                break
            time.sleep(0.1)
        h = sb.commands.run("cat", background=True, stdin=True)
        sb.commands.send_stdin(h.pid, "line one\\n")
        sb.commands.send_stdin(h.pid, "line two\\n")
        sb.commands.close_stdin(h.pid)
        res = h.wait()
        o["stdin"] = [res.exit_code, res.stdout]
        sb.kill()
        print(json.dumps(o))
    """)
    assert out["callbacks"] == ["out1\nout2\nout3\n", "err1\nerr2\nerr3\n"]
    assert out["result"] == ["out1\nout2\nout3\n", "err1\nerr2\nerr3\n"]
    assert out["listed"] is True
    assert out["bg"] == [0, "done-bg\n"]
    assert out["kill_bg"] is True and out["listed_after_kill"] is False
    assert out["stdin"] == [0, "line one\nline two\n"]


def test_stdin_turn_taking(sdk: SDK) -> None:
    """An interactive program: each line goes in only once the answer to the one before came
    out. Output must reach the caller while stdin is still open (no buffering until it
    closes), and input sent between turns must reach the process in order."""
    out = sdk.python(PY_LATEST, """
        import json
        from e2b import Sandbox
        sb = Sandbox.create(timeout=120)
        h = sb.commands.run('while read -r l; do echo "got:$l"; [ "$l" = 3 ] && exit 0; done',
                            background=True, stdin=True)
        text, sent = [], []
        def on_stdout(d):
            text.append(d)
            answered = [x for x in "".join(text).split("\\n")[:-1] if x.startswith("got:")]
            if len(answered) == len(sent) < 3:
                sent.append(str(len(sent) + 1))
                sb.commands.send_stdin(h.pid, sent[-1] + "\\n")
        sent.append("1")
        sb.commands.send_stdin(h.pid, "1\\n")
        res = h.wait(on_stdout=on_stdout)
        sb.kill()
        print(json.dumps({"code": res.exit_code, "stdout": res.stdout, "sent": sent}))
    """)
    assert out == {"code": 0, "stdout": "got:1\ngot:2\ngot:3\n", "sent": ["1", "2", "3"]}


def test_large_upload_and_download_stream_intact(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import hashlib, io, json, os
        from e2b import Sandbox
        sb = Sandbox.create(timeout=300)
        data = os.urandom(20 * 1024 * 1024)
        o = {"sha": hashlib.sha256(data).hexdigest()}
        sb.files.write("/home/user/big.bin", data)
        o["remote_sha"] = sb.commands.run("sha256sum /home/user/big.bin", timeout=120).stdout.split()[0]
        o["read_sha"] = hashlib.sha256(sb.files.read("/home/user/big.bin", format="bytes")).hexdigest()
        sb.files.write("/home/user/big2.bin", io.BytesIO(data))  # streamed octet-stream upload
        h = hashlib.sha256()
        n = 0
        for chunk in sb.files.read("/home/user/big2.bin", format="stream"):
            h.update(chunk)
            n += len(chunk)
        o["stream"] = [n, h.hexdigest()]
        sb.kill()
        print(json.dumps(o))
    """, timeout=600)
    assert out["remote_sha"] == out["sha"]
    assert out["read_sha"] == out["sha"]
    assert out["stream"] == [20 * 1024 * 1024, out["sha"]]


def test_timeout_list_filters_and_pagination(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json, time, uuid
        from e2b import Sandbox, SandboxQuery, SandboxState
        tag = uuid.uuid4().hex
        sbs = []
        for i in range(3):
            sbs.append(Sandbox.create(metadata={"tag": tag, "i": str(i)}, timeout=120))
            time.sleep(0.05)
        o = {"ids": [s.sandbox_id for s in sbs]}
        p = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}), limit=2)
        page1 = p.next_items()
        o["page1"] = [s.sandbox_id for s in page1]
        o["has_next"] = p.has_next
        page2 = p.next_items()
        o["page2"] = [s.sandbox_id for s in page2]
        o["has_next_after"] = p.has_next
        o["one"] = [s.metadata["i"] for s in Sandbox.list(query=SandboxQuery(metadata={"tag": tag, "i": "1"})).next_items()]
        o["none"] = len(Sandbox.list(query=SandboxQuery(metadata={"tag": "other"})).next_items())
        o["paused"] = len(Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, state=[SandboxState.PAUSED])).next_items())
        o["running"] = len(Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, state=[SandboxState.RUNNING])).next_items())
        before = sbs[0].get_info().end_at
        sbs[0].set_timeout(600)
        after = sbs[0].get_info().end_at
        o["extended"] = (after - before).total_seconds()
        sbs[1].set_timeout(1)
        time.sleep(3)
        o["expired_running"] = sbs[1].is_running()
        o["expired_listed"] = sbs[1].sandbox_id in [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"tag": tag})).next_items()]
        for s in sbs:
            s.kill()
        print(json.dumps(o))
    """)
    ids = out["ids"]
    assert out["page1"] == [ids[2], ids[1]] and out["has_next"] is True
    assert out["page2"] == [ids[0]] and out["has_next_after"] is False
    assert out["one"] == ["1"] and out["none"] == 0
    assert (out["paused"], out["running"]) == (0, 3)
    assert 470 < out["extended"] < 490
    assert out["expired_running"] is False and out["expired_listed"] is False


def test_get_host_reaches_a_server_in_the_sandbox(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json, os, time, httpx
        from e2b import Sandbox
        server = os.environ["AENV_TEST_SERVER"]
        sb = Sandbox.create(timeout=120)
        sb.files.write("/home/user/www/hello.txt", "hello from the sandbox")
        sb.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user/www")
        host = sb.get_host(8000)
        o = {"host": host, "id": sb.sandbox_id}
        for _ in range(100):  # the server takes a moment to listen
            r = httpx.get(server + "/hello.txt", headers={"Host": host})
            if r.status_code == 200:
                break
            time.sleep(0.2)
        o["get"] = [r.status_code, r.text]
        r = httpx.get(server + "/", headers={"Host": sb.get_host(8001)}, timeout=30)
        o["closed"] = [r.status_code, r.json()]
        r = httpx.get(server + "/", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8000"})
        o["by_headers"] = r.status_code
        r = httpx.post(server + "/init", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983"}, json={})
        o["init"] = r.status_code
        r = httpx.post(server + "/sync", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983"})
        o["sync"] = r.status_code
        # The same route in forms that httpx or the agent would normalise to it, sent as they are
        # (http.client does not touch the path): each must be refused, and the token must hold.
        import http.client, urllib.parse
        netloc = urllib.parse.urlsplit(server).netloc
        o["bypass"] = {}
        for raw in ("/./init", "/a/../init", "//x/init", "/%69nit", "/init/.", "//h/sync"):
            c = http.client.HTTPConnection(netloc, timeout=30)
            c.request("POST", raw, body=b'{"accessToken": "", "defaultUser": "root"}',
                      headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983",
                               "Content-Type": "application/json"})
            o["bypass"][raw] = c.getresponse().status
            c.close()
        o["still_user"] = sb.commands.run("whoami").stdout.strip()
        sb.kill()
        r = httpx.get(server + "/hello.txt", headers={"Host": host})
        o["killed"] = [r.status_code, r.json()]
        print(json.dumps(o))
    """)
    sid = out["id"]
    assert out["host"] == f"8000-{sid}.aenv.test"
    assert out["get"] == [200, "hello from the sandbox"]
    assert out["closed"] == [502, {"sandboxId": sid, "message": "The sandbox is running but port is not open",
                                   "port": 8001, "code": 502}]
    assert out["by_headers"] == 200
    assert out["init"] == 404 and out["sync"] == 404  # the host's control routes
    assert set(out["bypass"].values()) == {404}, out["bypass"]
    assert out["still_user"] == "user", "nothing reached the agent's /init"
    assert out["killed"] == [502, {"sandboxId": sid, "message": "The sandbox was not found", "code": 502}]


def test_get_host_reaches_a_server_that_listens_on_loopback_only(sdk: SDK) -> None:
    """Servers that bind 127.0.0.1 (dev servers, notebooks) are reachable as E2B's envd makes
    them: the guest agent forwards the port once the proxy finds it closed. Once the server
    stops, the port is closed again."""
    out = sdk.python(PY_LATEST, """
        import json, os, time, httpx
        from e2b import Sandbox
        server = os.environ["AENV_TEST_SERVER"]
        sb = Sandbox.create(timeout=120)
        sb.files.write("/home/user/www/hello.txt", "only on loopback")
        cmd = sb.commands.run("python3 -m http.server 8123 --bind 127.0.0.1", background=True, cwd="/home/user/www")
        o = {"id": sb.sandbox_id}
        for _ in range(100):
            r = httpx.get(server + "/hello.txt", headers={"Host": sb.get_host(8123)}, timeout=30)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        o["get"] = [r.status_code, r.text]
        o["again"] = httpx.get(server + "/hello.txt", headers={"Host": sb.get_host(8123)}).status_code
        o["tcp"] = sb.commands.run("cat /proc/net/tcp").stdout
        cmd.kill()
        for _ in range(50):  # the agent drops the forward within a second or two
            r = httpx.get(server + "/hello.txt", headers={"Host": sb.get_host(8123)}, timeout=30)
            if r.status_code == 502 and "port is not open" in r.text:
                break
            time.sleep(0.2)
        o["stopped"] = [r.status_code, r.text]
        # the port is free again: a server on all addresses can take it
        sb.commands.run("python3 -m http.server 8123", background=True, cwd="/home/user/www")
        for _ in range(100):
            r = httpx.get(server + "/hello.txt", headers={"Host": sb.get_host(8123)}, timeout=30)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        o["rebound"] = r.status_code
        o["tcp_after"] = sb.commands.run("cat /proc/net/tcp").stdout
        r = httpx.post(server + "/port-forward?port=8123", headers={"E2b-Sandbox-Id": sb.sandbox_id,
                       "E2b-Sandbox-Port": "49983"})
        o["internal"] = r.status_code
        sb.kill()
        print(json.dumps(o))
    """)
    assert out["get"] == [200, "only on loopback"], out
    assert out["again"] == 200
    listeners = [ln.split()[1] for ln in out["tcp"].splitlines()[1:] if ln.split()[3] == "0A"]
    assert "0100007F:1FBB" in listeners  # the server itself stays on loopback
    assert out["stopped"][0] == 502 and "port is not open" in out["stopped"][1], out["stopped"]
    assert out["rebound"] == 200
    listeners = [ln.split()[1] for ln in out["tcp_after"].splitlines()[1:] if ln.split()[3] == "0A"]
    assert "00000000:1FBB" in listeners  # 0.0.0.0:8123, the second server's own
    assert out["internal"] == 404  # the forward is asked for by the server only


def test_metrics_are_read_from_the_guest(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json, datetime
        from e2b import Sandbox
        sb = Sandbox.create(timeout=120)
        sb.commands.run("head -c 50000000 /dev/zero > /home/user/fill")  # 50 MB on the disk
        m = sb.get_metrics()
        early = sb.get_metrics(start=sb.get_info().started_at - datetime.timedelta(hours=2),
                               end=sb.get_info().started_at - datetime.timedelta(hours=1))
        o = {"n": len(m), "early": len(early)}
        if m:
            x = m[-1]
            o["m"] = [x.cpu_count, x.cpu_used_pct, x.mem_used, x.mem_total, x.mem_cache, x.disk_used, x.disk_total]
        df = sb.commands.run("df -B1 --output=used,size / | tail -1").stdout.split()
        o["df"] = [int(df[0]), int(df[1])]
        sb.pause()  # a paused sandbox's metrics are those it had (E2B answers them too)
        o["paused"] = len(Sandbox.get_metrics(sb.sandbox_id))
        sb.kill()
        print(json.dumps(o))
    """)
    assert out["n"] >= 1 and out["early"] == 0 and out["paused"] == out["n"]
    cpus, pct, mem_used, mem_total, mem_cache, disk_used, disk_total = out["m"]
    assert cpus == 1 and 0 <= pct <= 100
    assert 300 * 2**20 < mem_total <= 512 * 2**20 and 0 < mem_used < mem_total and 0 <= mem_cache < mem_total
    used, size = out["df"]
    assert disk_total == size and abs(disk_used - used) < 8 * 2**20 and disk_used > 50_000_000


def test_async_sdk(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import asyncio, json
        from e2b import AsyncSandbox, SandboxQuery
        async def main():
            sb = await AsyncSandbox.create(metadata={"suite": "async"}, envs={"V": "7"}, timeout=120)
            o = {"id": sb.sandbox_id}
            r = await sb.commands.run("echo $V")
            o["run"] = r.stdout
            seen = []
            h = await sb.commands.run("echo a; sleep 0.3; echo b", background=True, on_stdout=seen.append)
            res = await h.wait()
            o["bg"] = [res.stdout, "".join(seen)]
            await sb.files.write("/tmp/f.txt", "async data")
            o["read"] = await sb.files.read("/tmp/f.txt")
            o["exists"] = await sb.files.exists("/tmp/f.txt")
            o["list"] = [e.name for e in await sb.files.list("/tmp") if e.name == "f.txt"]
            p = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": "async"}))
            o["listed"] = [s.sandbox_id for s in await p.next_items()]
            await sb.set_timeout(200)
            o["running"] = await sb.is_running()
            await sb.kill()
            o["running_after"] = await sb.is_running()
            print(json.dumps(o))
        asyncio.run(main())
    """)
    assert out["run"] == "7\n"
    assert out["bg"] == ["a\nb\n", "a\nb\n"]
    assert out["read"] == "async data" and out["exists"] is True and out["list"] == ["f.txt"]
    assert out["listed"] == [out["id"]]
    assert out["running"] is True and out["running_after"] is False
