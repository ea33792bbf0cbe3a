"""The JS SDK (npm `e2b`), run by Node, against a real server."""

from __future__ import annotations

from tests.e2b.conftest import SDK


def test_js_sdk_create_run_files_list_kill(sdk: SDK) -> None:
    out = sdk.node("""
        import { Sandbox, CommandExitError } from 'e2b'
        const sb = await Sandbox.create({ metadata: { sdk: 'js' }, envs: { J: 'from-js' }, timeoutMs: 120_000 })
        const o = { id: sb.sandboxId }
        const r = await sb.commands.run('echo $J; id -un')
        o.run = [r.exitCode, r.stdout]
        try { await sb.commands.run('exit 4'); o.exit = null } catch (e) { o.exit = e instanceof CommandExitError ? e.exitCode : String(e) }
        const seen = []
        const bg = await sb.commands.run('echo a; sleep 0.2; echo b', { background: true, onStdout: (d) => seen.push(d) })
        o.bg = [(await bg.wait()).stdout, seen.join('')]
        await sb.files.write('/home/user/js/n.txt', 'node data')
        o.read = await sb.files.read('/home/user/js/n.txt')
        o.list = (await sb.files.list('/home/user/js')).map((e) => e.name)
        const big = new Uint8Array(5 * 1024 * 1024).map((_, i) => i % 251)
        await sb.files.write('/home/user/js/big.bin', big)
        const back = await sb.files.read('/home/user/js/big.bin', { format: 'bytes' })
        o.big = back.length === big.length && back.every((v, i) => v === big[i])
        o.exists = await sb.files.exists('/home/user/js/n.txt')
        const info = await sb.getInfo()
        o.info = [info.sandboxId, info.templateId, info.metadata, info.state]
        const page = await Sandbox.list({ query: { metadata: { sdk: 'js' } } }).nextItems()
        o.listed = page.map((s) => s.sandboxId)
        o.host = sb.getHost(3000)
        o.killed = await sb.kill()
        o.running = await sb.isRunning()
        console.log(JSON.stringify(o))
    """)
    sid = out["id"]
    assert out["run"] == [0, "from-js\nuser\n"]
    assert out["exit"] == 4
    assert out["bg"] == ["a\nb\n", "a\nb\n"]
    assert out["read"] == "node data" and out["list"] == ["n.txt"] and out["big"] is True and out["exists"] is True
    assert out["info"] == [sid, "base", {"sdk": "js"}, "running"]
    assert out["listed"] == [sid]
    assert out["host"] == f"3000-{sid}.aenv.test"
    assert out["killed"] is True and out["running"] is False
