"""An older SDK still in use: e2b 2.45 (v1 create route with the secure flag)."""

from __future__ import annotations

from tests.e2b.conftest import PY_245, SDK


def test_sdk_245_sync(sdk: SDK) -> None:
    out = sdk.python(PY_245, """
        import json, os, time, httpx
        from e2b import Sandbox, SandboxQuery, CommandExitException
        sb = Sandbox.create(metadata={"sdk": "2.45"}, envs={"E": "x"}, timeout=150)
        o = {"id": sb.sandbox_id}
        o["run"] = sb.commands.run("echo $E; id -un").stdout
        try:
            sb.commands.run("exit 7")
        except CommandExitException as e:
            o["exit"] = e.exit_code
        seen = []
        h = sb.commands.run("echo one; sleep 0.2; echo two", background=True)
        o["bg"] = [h.wait(on_stdout=seen.append).stdout, "".join(seen)]  # 2.45: callbacks go to wait()
        sb.files.write("/home/user/x/y.txt", "why")
        o["read"] = sb.files.read("/home/user/x/y.txt")
        o["list"] = [e.name for e in sb.files.list("/home/user/x")]
        sb.files.rename("/home/user/x/y.txt", "/home/user/x/z.txt")
        sb.files.remove("/home/user/x/z.txt")
        o["exists"] = sb.files.exists("/home/user/x/z.txt")
        o["listed"] = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"sdk": "2.45"})).next_items()]
        sb.set_timeout(400)
        i = sb.get_info()
        o["lifetime"] = (i.end_at - i.started_at).total_seconds()
        sb.commands.run("python3 -m http.server 8080", background=True, cwd="/etc")
        url = "http://" + sb.get_host(8080) + "/hostname"
        for _ in range(100):
            r = httpx.get(os.environ["AENV_TEST_SERVER"] + "/hostname", headers={"Host": sb.get_host(8080)})
            if r.status_code == 200:
                break
            time.sleep(0.2)
        o["http"] = r.status_code
        o["killed"] = sb.kill()
        o["running"] = sb.is_running()
        print(json.dumps(o))
    """)
    assert out["run"] == "x\nuser\n" and out["exit"] == 7
    assert out["bg"] == ["one\ntwo\n", "one\ntwo\n"]
    assert out["read"] == "why" and out["list"] == ["y.txt"] and out["exists"] is False
    assert out["listed"] == [out["id"]]
    assert out["lifetime"] > 390
    assert out["http"] == 200
    assert out["killed"] is True and out["running"] is False


def test_sdk_245_async(sdk: SDK) -> None:
    out = sdk.python(PY_245, """
        import asyncio, json
        from e2b import AsyncSandbox
        async def main():
            sb = await AsyncSandbox.create(timeout=120)
            o = {"run": (await sb.commands.run("echo async-245")).stdout}
            await sb.files.write("/tmp/a.txt", b"bytes!")
            o["read"] = await sb.files.read("/tmp/a.txt")
            o["info"] = (await sb.get_info()).state.value
            await sb.kill()
            o["running"] = await sb.is_running()
            print(json.dumps(o))
        asyncio.run(main())
    """)
    assert out == {"run": "async-245\n", "read": "bytes!", "info": "running", "running": False}
