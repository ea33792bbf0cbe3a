"""Pause, connect/resume, snapshots and fork through the official Python SDK (2.63 sync and
async, 2.45 sync), unchanged, against a real server."""

from __future__ import annotations

from tests.e2b.conftest import PY_245, PY_LATEST, SDK

SYNC = """
    import json, time
    from e2b import Sandbox, SandboxQuery, SandboxState
    o = {}
    sb = Sandbox.create(timeout=300, metadata={"suite": "saved"})
    sb.commands.run("nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i >> /tmp/c; sleep 0.05; done' >/dev/null 2>&1 &")
    sb.files.write("/home/user/keep.txt", "kept")
    o["pause"] = sb.pause()
    o["pause_again"] = Sandbox.pause(sb.sandbox_id) if hasattr(Sandbox, "pause") else None
    o["running_while_paused"] = sb.is_running()
    o["state"] = sb.get_info().state.value
    try:
        sb.set_timeout(60)
        o["timeout_while_paused"] = "set"
    except Exception as e:
        o["timeout_while_paused"] = type(e).__name__
    o["listed_paused"] = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
    again = Sandbox.connect(sb.sandbox_id, timeout=300)
    o["resumed_same_id"] = again.sandbox_id == sb.sandbox_id
    o["running_after"] = again.is_running()
    c1 = int(again.commands.run("tail -n1 /tmp/c").stdout); time.sleep(0.3)
    o["counter_goes_on"] = int(again.commands.run("tail -n1 /tmp/c").stdout) > c1
    o["file"] = again.files.read("/home/user/keep.txt")
    snap = again.create_snapshot(name="sdk-snap-VERSION")
    o["snap_names"] = snap.names
    again.files.write("/home/user/keep.txt", "changed after snapshot")
    child = Sandbox.create(snap.snapshot_id, timeout=120)
    o["from_snapshot"] = child.files.read("/home/user/keep.txt")
    child.kill()
    forks = again.fork(count=2, timeout=120)
    o["forks"] = [type(f).__name__ for f in forks]
    o["fork_files"] = [f.files.read("/home/user/keep.txt") for f in forks]
    forks[0].files.write("/home/user/keep.txt", "fork0")
    o["fork1_after_fork0_write"] = forks[1].files.read("/home/user/keep.txt")
    o["fork_ids_distinct"] = len({f.sandbox_id for f in forks} | {again.sandbox_id}) == 3
    for f in forks:
        f.kill()
    o["snapshots_listed"] = any(s.snapshot_id == snap.snapshot_id for s in Sandbox.list_snapshots().next_items())
    o["deleted"] = Sandbox.delete_snapshot(snap.snapshot_id)
    again.kill()
    print(json.dumps(o))
"""


def _check(out: dict) -> None:
    assert out["pause"] is True
    assert out["pause_again"] in (False, None)  # 409: already paused
    assert out["running_while_paused"] is False
    assert out["state"] == "paused"
    assert out["timeout_while_paused"] == "SandboxNotFoundException", out  # E2B answers 404
    assert out["listed_paused"], out
    assert out["resumed_same_id"] and out["running_after"]
    assert out["counter_goes_on"]
    assert out["file"] == "kept"
    assert out["from_snapshot"] == "kept"
    assert out["forks"] == ["Sandbox", "Sandbox"] or out["forks"] == ["AsyncSandbox", "AsyncSandbox"]
    assert out["fork_files"] == ["changed after snapshot", "changed after snapshot"]
    assert out["fork1_after_fork0_write"] == "changed after snapshot"
    assert out["fork_ids_distinct"]
    assert out["snapshots_listed"] and out["deleted"] is True


def test_pause_connect_snapshot_fork_sync(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, SYNC.replace("VERSION", "263"), timeout=600)
    assert out["snap_names"] and out["snap_names"][0].startswith("sdk-snap-263")
    _check(out)


def test_pause_connect_snapshot_fork_sdk_245(sdk: SDK) -> None:
    _check(sdk.python(PY_245, SYNC.replace("VERSION", "245"), timeout=600))


def test_pause_and_connect_async(sdk: SDK) -> None:
    out = sdk.python(PY_LATEST, """
        import asyncio, json
        from e2b import AsyncSandbox
        async def main():
            o = {}
            sb = await AsyncSandbox.create(timeout=300)
            await sb.files.write("/home/user/a.txt", "async")
            o["pause"] = await sb.pause()
            o["info"] = (await sb.get_info()).state.value
            sb2 = await AsyncSandbox.connect(sb.sandbox_id, timeout=300)
            o["read"] = await sb2.files.read("/home/user/a.txt")
            forks = await sb2.fork(count=1)
            o["fork_read"] = await forks[0].files.read("/home/user/a.txt")
            await forks[0].kill()
            await sb2.kill()
            print(json.dumps(o))
        asyncio.run(main())
    """, timeout=600)
    assert out == {"pause": True, "info": "paused", "read": "async", "fork_read": "async"}


def test_snapshot_and_fork_do_not_cut_traffic_to_the_sandbox(sdk: SDK) -> None:
    """A snapshot or a fork stops the sandbox only for its capture: a command streaming its
    output through the proxy meanwhile keeps streaming, and commands sent meanwhile run (E2B
    lists the sandbox as running throughout)."""
    out = sdk.python(PY_LATEST, """
        import json, threading
        from e2b import Sandbox
        o = {"errors": []}
        sb = Sandbox.create(timeout=300)
        h = sb.commands.run("for i in $(seq 1 60); do echo $i; sleep 0.05; done", background=True)
        done = threading.Event()
        def poke():
            while not done.is_set():
                try:
                    assert sb.commands.run("echo ok").stdout == "ok\\n"
                    sb.get_info()
                except Exception as exc:
                    o["errors"].append(repr(exc)[:300])
        t = threading.Thread(target=poke)
        t.start()
        snaps = [sb.create_snapshot() for _ in range(2)]
        forks = sb.fork(count=1, timeout=120)
        done.set()
        t.join()
        r = h.wait()
        o["exit"], o["lines"] = r.exit_code, r.stdout.split()
        o["fork_runs"] = forks[0].commands.run("echo child").stdout
        for f in forks:
            f.kill()
        for snap in snaps:
            Sandbox.delete_snapshot(snap.snapshot_id)
        sb.kill()
        print(json.dumps(o))
    """, timeout=600)
    assert out["errors"] == [], out["errors"]
    assert out["exit"] == 0 and out["lines"] == [str(i) for i in range(1, 61)], out
    assert out["fork_runs"] == "child\n"


def test_filesystem_only_pause_snapshot_and_reboot(sdk: SDK) -> None:
    """SDK 2.63's ``mode="filesystem"`` (pause and snapshot) and ``on_resume="reboot"``: files
    are kept, the guest boots again (new boot_id), the sandbox's env vars are still there."""
    out = sdk.python(PY_LATEST, """
        import json
        from e2b import Sandbox
        o = {}
        boot = lambda s: s.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        sb = Sandbox.create(timeout=300, envs={"MINE": "kept-env"})
        sb.files.write("/home/user/fs.txt", "on disk")
        b0 = boot(sb)
        o["pause"] = sb.pause(mode="filesystem")
        o["info"] = sb.get_info().state.value
        sb = Sandbox.connect(sb.sandbox_id, timeout=300)
        b1 = boot(sb)
        o["rebooted"] = b1 != b0
        o["file"] = sb.files.read("/home/user/fs.txt")
        o["env"] = sb.commands.run("echo $MINE").stdout.strip()
        sb.pause()
        sb = Sandbox.connect(sb.sandbox_id, timeout=300, on_resume="reboot")
        o["reboot_on_resume"] = boot(sb) not in (b0, b1)
        snap = sb.create_snapshot(mode="filesystem")
        child = Sandbox.create(snap.snapshot_id, timeout=120)
        o["snapshot_file"] = child.files.read("/home/user/fs.txt")
        child.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
        sb.kill()
        print(json.dumps(o))
    """, timeout=600)
    assert out == {"pause": True, "info": "paused", "rebooted": True, "file": "on disk", "env": "kept-env",
                   "reboot_on_resume": True, "snapshot_file": "on disk"}


def test_snapshot_list_pages_and_name_filter(sdk: SDK) -> None:
    """Sandbox.list_snapshots pages with limit/next_token, newest first, and takes a name
    as the SDK documents it: plain, namespaced, or with the default tag (no other tags here)."""
    out = sdk.python(PY_LATEST, """
        import json
        from e2b import Sandbox
        sb = Sandbox.create(timeout=300)
        made = [sb.create_snapshot(name=f"page-{i}").snapshot_id for i in range(3)]
        o = {"made": made, "pages": []}
        p = sb.list_snapshots(limit=2)
        while p.has_next:
            o["pages"].append([s.snapshot_id for s in p.next_items()])
        o["by_name"] = {n: [s.snapshot_id for s in Sandbox.list_snapshots(name=n).next_items()]
                        for n in ("page-1", "team/page-1:default", "page-1:v2", made[0])}
        for s in made:
            Sandbox.delete_snapshot(s)
        sb.kill()
        print(json.dumps(o))
    """, timeout=600)
    made = out["made"]
    assert out["pages"] == [[made[2], made[1]], [made[0]]]
    assert out["by_name"] == {"page-1": [made[1]], "team/page-1:default": [made[1]], "page-1:v2": [],
                              made[0]: [made[0]]}
