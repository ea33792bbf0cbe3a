"""Directory watching and PTY sessions through the official Python SDK 2.63 (sync watcher
polling, async watch stream, PTY create/input/resize)."""

from __future__ import annotations

from tests.e2b.conftest import PY_LATEST, SDK


def test_watch_dir_sync_and_async(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import asyncio, json, time
        from e2b import Sandbox, AsyncSandbox
        o = {}
        sb = Sandbox.create(timeout=120)
        sb.files.make_dir("/home/user/w/sub")
        h = sb.files.watch_dir("/home/user/w", recursive=True)
        sb.files.write("/home/user/w/a.txt", "a")
        sb.files.write("/home/user/w/sub/b.txt", "b")
        sb.files.remove("/home/user/w/a.txt")
        time.sleep(0.5)
        o["sync"] = sorted({(e.name, e.type.value) for e in h.get_new_events()})
        h.stop()
        sb.kill()

        async def main():
            asb = await AsyncSandbox.create(timeout=120)
            await asb.files.make_dir("/home/user/v")
            seen = []
            wh = await asb.files.watch_dir("/home/user/v", on_event=lambda e: seen.append((e.name, e.type.value)))
            await asb.files.write("/home/user/v/c.txt", "c")
            await asb.commands.run("mv /home/user/v/c.txt /home/user/v/d.txt")
            for _ in range(50):
                if any(n == "d.txt" for n, _ in seen):
                    break
                await asyncio.sleep(0.1)
            await wh.stop()
            await asb.kill()
            return sorted(set(seen))
        o["async"] = asyncio.run(main())
        print(json.dumps(o))
    """)
    sync = {tuple(x) for x in out["sync"]}
    assert ("a.txt", "create") in sync and ("a.txt", "remove") in sync, sync
    assert ("sub/b.txt", "create") in sync, sync
    names = {n for n, _ in out["async"]}
    assert {"c.txt", "d.txt"} <= names, out["async"]
    assert ("d.txt", "rename") in {tuple(x) for x in out["async"]} or ("c.txt", "rename") in {
        tuple(x) for x in out["async"]}, out["async"]


def test_pty_session(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import json
        from e2b import Sandbox
        from e2b.sandbox.commands.command_handle import PtySize
        sb = Sandbox.create(timeout=120)
        chunks = []
        h = sb.pty.create(PtySize(cols=80, rows=24))
        sb.pty.send_stdin(h.pid, b"echo $((6*7))\\n")
        sb.pty.resize(h.pid, PtySize(cols=100, rows=30))
        sb.pty.send_stdin(h.pid, b"stty size; exit 5\\n")
        try:
            r = h.wait(on_pty=lambda d: chunks.append(d))
            code = r.exit_code
        except Exception as e:  # CommandExitException for a non-zero exit
            code = getattr(e, "exit_code", None)
        text = b"".join(chunks).decode(errors="replace")
        sb.kill()
        print(json.dumps({"code": code, "has42": "42" in text, "size": "30 100" in text}))
    """)
    assert out == {"code": 5, "has42": True, "size": True}
