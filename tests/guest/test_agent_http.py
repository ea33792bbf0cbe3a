"""The guest agent's plain HTTP side and its answers to bad input: /metrics, gzip and large
/files transfers, access-token coverage of every route, unknown processes, path resolution,
non-UTF-8 names, a full disk, malformed requests, and the login environment of commands.

The agent runs as a real subprocess (conftest.py) and is driven over HTTP as a client would.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import pwd
import re
import socket
import subprocess
import time
import urllib.parse
import zlib
from pathlib import Path

import httpx
import pytest

from agentenv.envd_client import EnvdClient, EnvdError

from .test_agent import CONNECT_JSON, envelope, parse_envelopes

pytestmark = pytest.mark.timeout(180)

JSON = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------------------------
# GET /metrics
# ---------------------------------------------------------------------------------------------


async def test_metrics_report_this_machine(client: EnvdClient) -> None:
    before = time.time()
    m = await client.metrics()
    assert set(m) == {"ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache",
                      "mem_total_mib", "mem_used_mib", "disk_used", "disk_total"}
    assert before - 1 <= m["ts"] <= time.time() + 1
    assert m["cpu_count"] == os.cpu_count()
    meminfo = {k: int(v.split()[0]) * 1024 for k, v in
               (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    assert m["mem_total"] == meminfo["MemTotal"]
    assert 0 < m["mem_used"] < m["mem_total"]
    assert m["mem_total_mib"] == m["mem_total"] // 2**20
    st = os.statvfs("/")
    assert m["disk_total"] == st.f_blocks * st.f_frsize
    assert 0 < m["disk_used"] <= m["disk_total"]
    assert 0.0 <= m["cpu_used_pct"] <= 100.0

    # A CPU-bound process shows up in the next sample.
    burner = asyncio.create_task(client.run(["timeout", "2", "sh", "-c", "while :; do :; done"]))
    await asyncio.sleep(0.3)
    await client.metrics()
    await asyncio.sleep(0.6)
    busy = (await client.metrics())["cpu_used_pct"]
    assert busy >= 100 / os.cpu_count() * 0.6, busy
    await burner


# ---------------------------------------------------------------------------------------------
# /files: gzip and large transfers
# ---------------------------------------------------------------------------------------------


async def test_download_gzip_negotiation(http: httpx.AsyncClient, tmp_path: Path) -> None:
    data = b"compressible line of text\n" * 50000
    (tmp_path / "t.txt").write_bytes(data)
    params = {"path": str(tmp_path / "t.txt")}
    async with http.stream("GET", "/files", params=params, headers={"Accept-Encoding": "gzip"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-encoding"] == "gzip"
        assert "accept-encoding" in resp.headers["vary"].lower()
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    assert gzip.decompress(raw) == data
    assert len(raw) < len(data) // 20

    for accept in ("identity", "br", "gzip;q=0", "zstd, identity;q=0.5"):
        resp = await http.get("/files", params=params, headers={"Accept-Encoding": accept})
        assert resp.status_code == 200 and "content-encoding" not in resp.headers, accept
        assert int(resp.headers["content-length"]) == len(data) and resp.content == data
    resp = await http.get("/files", params=params, headers={"Accept-Encoding": "identity;q=0"})
    assert resp.status_code == 406 and resp.json()["code"] == 406

    (tmp_path / "empty").write_bytes(b"")
    resp = await http.get("/files", params={"path": str(tmp_path / "empty")}, headers={"Accept-Encoding": "gzip"})
    assert resp.status_code == 200 and resp.content == b""


async def test_download_of_incompressible_data_is_not_gzipped(http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Deflating random or already-compressed bytes only costs the sandbox CPU: even a client
    that accepts gzip (every httpx client does by default) gets them as they are, with a length."""
    data = os.urandom(3 * 1024 * 1024 + 17)
    (tmp_path / "r.bin").write_bytes(data)
    for accept in ("gzip", "gzip, deflate", "zstd,gzip,br"):
        async with http.stream("GET", "/files", params={"path": str(tmp_path / "r.bin")},
                               headers={"Accept-Encoding": accept}) as resp:
            assert resp.status_code == 200 and "content-encoding" not in resp.headers, accept
            assert int(resp.headers["content-length"]) == len(data)
            assert b"".join([c async for c in resp.aiter_raw()]) == data
    async with http.stream("GET", "/files", params={"path": str(tmp_path / "r.bin")},
                           headers={"Accept-Encoding": "gzip, identity;q=0"}) as resp:  # identity refused
        assert resp.headers["content-encoding"] == "gzip"
        assert gzip.decompress(b"".join([c async for c in resp.aiter_raw()])) == data


async def test_200mb_both_ways_with_bounded_memory(agent, http: httpx.AsyncClient, client: EnvdClient,
                                                   tmp_path: Path) -> None:
    size, chunk = 200 * 1024 * 1024, 1024 * 1024
    block = os.urandom(16 * 1024)

    def piece(i: int) -> bytes:
        return (i.to_bytes(8, "big") + block) * (chunk // (len(block) + 8)) + i.to_bytes(8, "big") * 8

    pieces = [len(piece(i)) for i in range(size // chunk)]
    total = sum(pieces)
    expected = hashlib.sha256()
    for i in range(size // chunk):
        expected.update(piece(i))

    def peak_rss_kib() -> int:
        return int(re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{agent.pid}/status").read_text()).group(1))

    before = peak_rss_kib()

    async def produce():
        for i in range(size // chunk):
            yield piece(i)

    target = tmp_path / "big.bin"
    await client.write_file(str(target), produce())  # chunked, streamed
    assert target.stat().st_size == total

    got = hashlib.sha256()
    async for part in client.download(str(target)):
        got.update(part)
    assert got.hexdigest() == expected.hexdigest()

    got, raw_len = hashlib.sha256(), 0
    inflate = zlib.decompressobj(wbits=31)
    async with http.stream("GET", "/files", params={"path": str(target)}, headers={"Accept-Encoding": "gzip"}) as resp:
        assert resp.headers["content-encoding"] == "gzip"
        async for raw in resp.aiter_raw():
            raw_len += len(raw)
            got.update(inflate.decompress(raw))
    got.update(inflate.flush())
    assert got.hexdigest() == expected.hexdigest()
    assert raw_len < total

    async def produce_gzip():
        deflate = zlib.compressobj(1, zlib.DEFLATED, 31)
        for i in range(size // chunk):
            yield deflate.compress(piece(i))
        yield deflate.flush()

    target2 = tmp_path / "big-from-gzip.bin"
    resp = await http.post("/files", params={"path": str(target2)}, content=produce_gzip(),
                           headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert resp.status_code == 200, resp.text
    with open(target2, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == expected.hexdigest()

    grown_mib = (peak_rss_kib() - before) / 1024
    assert grown_mib < 40, f"agent peak RSS grew by {grown_mib:.0f} MiB: it buffered a file"


# ---------------------------------------------------------------------------------------------
# Access token on every route
# ---------------------------------------------------------------------------------------------

RPCS = [f"process.Process/{m}" for m in ("Start", "Connect", "List", "SendSignal", "SendInput", "CloseStdin",
                                          "Update", "StreamInput")] + \
       [f"filesystem.Filesystem/{m}" for m in ("Stat", "ListDir", "MakeDir", "Move", "Remove", "WatchDir",
                                               "CreateWatcher", "GetWatcherEvents", "RemoveWatcher")]


async def test_token_required_on_every_route_but_health_and_files(http: httpx.AsyncClient, client: EnvdClient,
                                                                  tmp_path: Path) -> None:
    """Once a token is set, every route needs it (``/files`` may use a signature instead), the
    host's ``/init`` too: it could otherwise clear the token and take over the sandbox."""
    await client.init(sandbox_id="s", template_id="t", env_vars={}, access_token="tok")
    victim = tmp_path / "made-by-attacker"
    for token in (None, "wrong", "TOK", ""):
        headers = {"X-Access-Token": token} if token is not None else {}
        for rpc in RPCS:
            body = json.dumps({"path": str(victim)}).encode()
            streaming = rpc.endswith(("Start", "Connect", "StreamInput", "WatchDir"))
            resp = await http.post(f"/{rpc}", content=envelope({"path": str(victim)}) if streaming else body,
                                   headers={**(CONNECT_JSON if streaming else JSON), **headers})
            assert resp.status_code == 401, (rpc, token, resp.status_code)
            assert resp.json()["code"] == 401
        for path in ("/envs", "/metrics", "/no-such-route"):
            assert (await http.get(path, headers=headers)).status_code == 401, path
        assert (await http.post("/sync", headers=headers)).status_code == 401
        resp = await http.post("/init", json={"accessToken": "", "defaultUser": "root"}, headers=headers)
        assert resp.status_code == 401
        # /files without a valid token or signature
        assert (await http.get("/files", params={"path": "/etc/hostname"}, headers=headers)).status_code == 401
        resp = await http.post("/files", params={"path": str(victim)}, content=b"x",
                               headers={**headers, "Content-Type": "application/octet-stream"})
        assert resp.status_code == 401
    assert not victim.exists(), "a refused request must not have had any effect"

    ok = {"X-Access-Token": "tok"}
    assert (await http.get("/health")).status_code == 204
    assert (await http.get("/metrics", headers=ok)).status_code == 200
    assert (await http.get("/envs", headers=ok)).status_code == 200
    assert (await http.post("/sync", headers=ok)).status_code == 204  # the host's, before a filesystem-only pause
    assert (await http.post("/init", json={"envVars": {"K": "v"}}, headers=ok)).status_code == 204
    assert (await http.get("/envs", headers=ok)).json()["K"] == "v", "the token still holds after an /init"
    resp = await http.post("/filesystem.Filesystem/MakeDir", content=json.dumps({"path": str(victim)}), headers={**JSON, **ok})
    assert resp.status_code == 200 and victim.is_dir()
    assert (await http.get("/files", params={"path": "/etc/hostname"}, headers=ok)).status_code == 200


# ---------------------------------------------------------------------------------------------
# Unknown processes
# ---------------------------------------------------------------------------------------------


async def test_unknown_pid_or_tag_is_not_found(http: httpx.AsyncClient) -> None:
    for selector in ({"pid": 999999}, {"tag": "no-such-tag"}, {}):
        for rpc, extra in (("SendSignal", {"signal": "SIGNAL_SIGKILL"}), ("SendInput", {"input": {"stdin": "eA=="}}),
                           ("CloseStdin", {}), ("Update", {"pty": {"size": {"cols": 10, "rows": 10}}})):
            resp = await http.post(f"/process.Process/{rpc}", content=json.dumps({"process": selector, **extra}),
                                   headers=JSON)
            assert resp.status_code == 404, (rpc, selector, resp.text)
            assert resp.json()["code"] == "not_found"
        resp = await http.post("/process.Process/Connect", content=envelope({"process": selector}), headers=CONNECT_JSON)
        frames = parse_envelopes(resp.content)
        assert frames == [(2, {"error": {"code": "not_found", "message": frames[0][1]["error"]["message"]}})]


async def test_finished_processes_are_found_by_pid_or_tag(http: httpx.AsyncClient, client: EnvdClient) -> None:
    """Process.Connect to a command that already ended replays its end, however it is named:
    the pid as a number or a string, or its tag, among many other finished commands."""
    pids = []
    for i in range(30):
        events = [ev async for ev in client.stream(["sh", "-c", f"exit {i % 5}"], tag=f"job-{i}")]
        pids.append(events[0].pid)
    for i in (0, 17, 29):
        for selector in ({"pid": pids[i]}, {"pid": str(pids[i])}, {"tag": f"job-{i}"}):
            resp = await http.post("/process.Process/Connect", content=envelope({"process": selector}),
                                   headers=CONNECT_JSON)
            frames = parse_envelopes(resp.content)
            assert frames[0] == (0, {"event": {"start": {"pid": pids[i]}}}), (selector, frames)
            end = frames[1][1]["event"]["end"]
            assert end.get("exitCode", 0) == i % 5 and end["exited"], (selector, frames)


async def test_a_command_not_on_path_fails_to_start(client: EnvdClient, tmp_path: Path) -> None:
    """A command name that is not on PATH fails the Start call (as envd's does), also when an
    earlier command of that name ran and its file is gone since; one added later runs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    envs = {"PATH": f"{bindir}:/usr/bin:/bin"}
    with pytest.raises(EnvdError, match="no such executable"):
        await client.run(["aenv-test-tool"], envs=envs)
    tool = bindir / "aenv-test-tool"
    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    assert (await client.run(["aenv-test-tool"], envs=envs)).stdout == b"tool ran\n"
    tool.unlink()
    with pytest.raises(EnvdError, match="no such executable"):
        await client.run(["aenv-test-tool"], envs=envs)
    tool.write_text("#!/bin/sh\necho back\n")
    tool.chmod(0o755)
    assert (await client.run(["aenv-test-tool"], envs=envs)).stdout == b"back\n"


async def test_a_command_that_cannot_be_executed_fails_to_start_as_envds_does(client: EnvdClient,
                                                                             tmp_path: Path) -> None:
    """A program that does not exist or may not be executed fails the Start call with
    invalid_argument, as envd's (Go's os/exec) does, instead of a process that exits 127; a
    script without a shebang runs through /bin/sh, however many arguments it is given (its
    argument vector is copied onto the spawn's own stack)."""
    with pytest.raises(EnvdError, match="No such file or directory") as missing:
        await client.run(["/nonexistent/aenv-tool"])
    assert missing.value.code == "invalid_argument"
    plain = tmp_path / "not-executable"
    plain.write_text("echo should not run\n")
    plain.chmod(0o644)
    with pytest.raises(EnvdError, match="Permission denied") as denied:
        await client.run([str(plain)])
    assert denied.value.code == "invalid_argument"
    script = tmp_path / "no-shebang"
    script.write_text('echo "$# $1 ${100000}"\n')
    script.chmod(0o755)
    many = [f"a{i}" for i in range(1, 100_001)]
    result = await client.run([str(script), *many], timeout=120)
    assert (result.exit_code, result.stdout) == (0, b"100000 a1 a100000\n"), result
    assert (await client.run(["/bin/echo", "still", "serving"])).stdout == b"still serving\n"


def test_finished_processes_expire_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finished-process registry forgets those past FINISHED_TTL, in the order they ended,
    and keeps the rest (imported as the guest imports it: the agent's directory on sys.path)."""
    import sys
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "src" / "agentenv" / "guest"))
    monkeypatch.delitem(sys.modules, "agentlib.process", raising=False)
    from agentlib.process import FINISHED_TTL, ProcessManager

    procs = ProcessManager(agent=None)
    now = time.monotonic()
    ages = [FINISHED_TTL + 60, FINISHED_TTL + 1, 10, 5]  # in the order they finished
    for pid, age in enumerate(ages, start=100):
        procs.running[pid] = SimpleNamespace(pid=pid, finished_at=now - age)
    for pid in range(100, 100 + len(ages)):
        procs._finish(procs.running[pid])
    assert list(procs.finished) == [102, 103] and not procs.running
    procs._finish(SimpleNamespace(pid=102, finished_at=time.monotonic()))  # a reused pid ends again
    assert list(procs.finished) == [103, 102]


# ---------------------------------------------------------------------------------------------
# Paths: traversal, symlinks, non-UTF-8 names
# ---------------------------------------------------------------------------------------------


async def test_paths_resolve_as_linux_does(http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    home = pwd.getpwuid(os.geteuid()).pw_dir
    depth = len(Path(home).parts) - 1
    up = "/".join([".."] * (depth + 2))  # more ".." than there are levels: stops at "/", like the kernel
    assert (await client.stat(f"{up}/etc"))["path"] == "/etc"
    resp = await http.get("/files", params={"path": f"{up}/etc/hostname"})
    assert resp.status_code == 200 and resp.content == Path("/etc/hostname").read_bytes()

    # ".." after a symlink goes to the parent of the link's *target*, as open(2) does.
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "real" / "marker").write_bytes(b"physical")
    (tmp_path / "link").symlink_to(tmp_path / "real" / "inner")
    via_link = f"{tmp_path}/link/../marker"
    assert Path(via_link).read_bytes() == b"physical"  # what Linux does
    assert (await client.stat(via_link))["path"] == str(tmp_path / "real" / "marker")
    assert await client.read_file(via_link) == b"physical"
    await client.write_file(f"{tmp_path}/link/../written.txt", b"w")
    assert (tmp_path / "real" / "written.txt").read_bytes() == b"w"
    assert await client.make_dir(f"{tmp_path}/link/../newdir") is True
    assert (tmp_path / "real" / "newdir").is_dir()
    # A final symlink is the link itself (lstat), not resolved away.
    assert (await client.stat(str(tmp_path / "link")))["symlinkTarget"] == str(tmp_path / "real" / "inner")

    resp = await http.post("/filesystem.Filesystem/Stat", content=json.dumps({"path": "/etc\u0000/passwd"}), headers=JSON)
    assert resp.status_code == 400 and resp.json()["code"] == "invalid_argument"
    resp = await http.get("/files", params={"path": "/etc\u0000/passwd"})
    assert resp.status_code == 400


async def test_non_utf8_and_unicode_names(http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    tmp_path = tmp_path / "names"
    tmp_path.mkdir()
    raw_dir = os.fsencode(tmp_path)
    with open(raw_dir + b"/caf\xe9.txt", "wb") as f:  # Latin-1 bytes: not valid UTF-8
        f.write(b"latin")
    name = os.fsdecode(b"caf\xe9.txt")  # how Python (and the agent) spell it: 'caf\udce9.txt'
    entries = await client.list_dir(str(tmp_path))
    assert [e["name"] for e in entries] == [name]
    assert (await client.stat(entries[0]["path"]))["size"] == "5"
    quoted = urllib.parse.quote(raw_dir + b"/caf\xe9.txt")
    resp = await http.get(f"/files?path={quoted}")
    assert resp.status_code == 200 and resp.content == b"latin"
    new_raw = raw_dir + b"/new-\xff.bin"
    resp = await http.post(f"/files?path={urllib.parse.quote(new_raw)}", content=b"up",
                           headers={"Content-Type": "application/octet-stream"})
    assert resp.status_code == 200
    assert Path(os.fsdecode(new_raw)).read_bytes() == b"up"
    await client.remove(os.fsdecode(raw_dir + b"/new-\xff.bin"))
    assert not os.path.exists(raw_dir + b"/new-\xff.bin")

    uni = tmp_path / "日本語 ü \"q\".txt"
    uni.write_bytes(b"unicode")
    resp = await http.get("/files", params={"path": str(uni)})
    assert resp.status_code == 200 and resp.content == b"unicode"
    disposition = resp.headers["content-disposition"]
    assert disposition.isascii()
    assert urllib.parse.unquote(disposition.split("filename*=UTF-8''")[1]) == uni.name


# ---------------------------------------------------------------------------------------------
# Full disk
# ---------------------------------------------------------------------------------------------


async def test_full_disk_keeps_old_content_and_leaves_no_partial_file(http: httpx.AsyncClient, client: EnvdClient,
                                                                      tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)  # tests run as root
    try:
        (small / "keep.txt").write_bytes(b"old content")
        with pytest.raises(EnvdError) as err:
            await client.write_file(str(small / "keep.txt"), b"n" * (3 * 1024 * 1024))
        assert err.value.status == 507 and err.value.code == "resource_exhausted"
        assert (small / "keep.txt").read_bytes() == b"old content"
        assert sorted(p.name for p in small.iterdir()) == ["keep.txt"]

        # gzip body that only inflates past the free space; multipart too.
        resp = await http.post("/files", params={"path": str(small / "bomb.bin")}, content=gzip.compress(b"\0" * (4 << 20)),
                               headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert resp.status_code == 507 and resp.json() == {"code": 507, "message": resp.json()["message"]}
        resp = await http.post("/files", files={"file": (str(small / "m.bin"), b"m" * (3 << 20))})
        assert resp.status_code == 507
        assert sorted(p.name for p in small.iterdir()) == ["keep.txt"]
        assert (await http.get("/health")).status_code == 204
    finally:
        subprocess.run(["umount", str(small)], check=False)


# ---------------------------------------------------------------------------------------------
# Malformed requests
# ---------------------------------------------------------------------------------------------


async def test_malformed_requests_leave_the_agent_serving(agent, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=agent.url, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        cases = [
            ("filesystem.Filesystem/Stat", b"{\"path\": ", JSON, "invalid_argument"),
            ("filesystem.Filesystem/Stat", b"\"just a string\"", JSON, "invalid_argument"),
            ("filesystem.Filesystem/ListDir", b"\xff\xfe", JSON, "invalid_argument"),
            ("filesystem.Filesystem/WatchDir", envelope({"path": "/"})[:-1], CONNECT_JSON, "invalid_argument"),
            ("filesystem.Filesystem/WatchDir", b"\x00\x00\x00\x00\x05[1,2]", CONNECT_JSON, "invalid_argument"),
            ("process.Process/Start", b"\x02\x00\x00\x00\x02{}", CONNECT_JSON, "invalid_argument"),
            ("process.Process/Start", envelope({"process": {"cmd": "true", "envs": "not a map"}}), CONNECT_JSON,
             "invalid_argument"),
        ]
        for rpc, body, headers, code in cases:
            resp = await http.post(f"/{rpc}", content=body, headers=headers)
            if headers is JSON:
                assert resp.status_code == 400 and resp.json()["code"] == code, (rpc, body, resp.text)
            else:
                frames = parse_envelopes(resp.content)
                assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == code, (rpc, body, frames)
            resp = await http.post("/filesystem.Filesystem/Stat", content=b'{"path": "/"}', headers=JSON)
            assert resp.status_code == 200, "the same connection must serve the next request"

        # A truncated gzip upload is refused and leaves no file.
        resp = await http.post("/files", params={"path": str(tmp_path / "trunc.bin")},
                               content=gzip.compress(os.urandom(100_000))[:-100],
                               headers={"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
        assert resp.status_code == 400 and "gzip" in resp.json()["message"]
        assert not (tmp_path / "trunc.bin").exists()

    # Broken HTTP framing gets a 400 and a closed connection; the agent itself is unaffected.
    host, port = agent.url.removeprefix("http://").split(":")
    for raw in (b"POST /filesystem.Filesystem/Stat HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nContent-Length: nope\r\n\r\n"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 400"), answer
    # A head over the reader's limit is refused the same way.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n")  # limit: 256 KiB
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"too large" in answer, answer[:200]
    # A head that arrives in pieces, after empty lines, is one request; the connection serves the next.
    reader, writer = await asyncio.open_connection(host, int(port))
    for piece in (b"\r\n\r\nGET /hea", b"lth HTTP/1.1\r\nHost: x\r", b"\n\r\n", b"GET /health HTTP/1.1\r\n\r\n"):
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.05)
    first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    second = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert first.startswith(b"HTTP/1.1 204") and second.startswith(b"HTTP/1.1 204"), (first, second)
    with socket.create_connection((host, int(port))) as s:  # a client that vanishes mid-body
        s.sendall(b"POST /files?path=" + str(tmp_path / "cut.bin").encode() + b" HTTP/1.1\r\nContent-Length: 100000\r\n"
                  b"Content-Type: application/octet-stream\r\n\r\n" + b"x" * 5000)
    await asyncio.sleep(0.3)
    assert not (tmp_path / "cut.bin").exists(), "an interrupted upload must leave no file"
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".aenv-upload-")] == []
    assert httpx.get(agent.url + "/health").status_code == 204


# ---------------------------------------------------------------------------------------------
# Commands as the SDK runs them
# ---------------------------------------------------------------------------------------------


async def test_commands_get_a_login_environment(client: EnvdClient) -> None:
    me = pwd.getpwuid(os.geteuid())
    probe = 'echo "$HOME|$USER|$LOGNAME|$PATH|$PWD|$0"; shopt -q login_shell && echo login'
    result = await client.run(probe)  # a string: /bin/bash -l -c, as the SDK sends it
    assert result.exit_code == 0, result
    # The same probe in a fresh login shell of that user, started in its home: identical output.
    login = subprocess.run(["/bin/bash", "-l", "-c", probe], capture_output=True, cwd=me.pw_dir,
                           env={"HOME": me.pw_dir, "USER": me.pw_name, "LOGNAME": me.pw_name,
                                "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert result.stdout == login.stdout
    assert result.stdout.decode().startswith(f"{me.pw_dir}|{me.pw_name}|{me.pw_name}|")
    assert result.stdout.decode().endswith("|/bin/bash\nlogin\n")

    nobody = pwd.getpwnam("nobody")
    result = await client.run("echo $HOME $USER; pwd", user="nobody")
    home_exists = os.path.isdir(nobody.pw_dir)
    assert result.stdout.decode() == f"{nobody.pw_dir} nobody\n{nobody.pw_dir if home_exists else '/'}\n"


# ---------------------------------------------------------------------------------------------
# Upload metadata and ranged downloads
# ---------------------------------------------------------------------------------------------


async def test_upload_metadata_is_stored_replaced_and_validated(http: httpx.AsyncClient, client: EnvdClient,
                                                                tmp_path: Path) -> None:
    target = tmp_path / "meta.txt"
    resp = await http.post("/files", params={"path": str(target)}, content=b"v1",
                           headers={"Content-Type": "application/octet-stream", "X-Metadata-Owner": "me",
                                    "X-Metadata-Build-ID": "42"})
    assert resp.status_code == 200, resp.text
    assert resp.json()[0]["metadata"] == {"owner": "me", "build-id": "42"}
    assert os.getxattr(target, "user.e2b.owner") == b"me"
    assert (await client.stat(str(target)))["metadata"] == {"owner": "me", "build-id": "42"}

    await client.write_file(str(target), b"v2")  # an upload without metadata clears it
    assert "metadata" not in await client.stat(str(target))
    assert target.read_bytes() == b"v2"

    for bad in ({"X-Metadata-K": "caf\u00e9".encode("latin-1")}, {"X-Metadata-" + "k" * 247: "v"},
                {f"X-Metadata-K{i}": "v" * 100 for i in range(45)}):
        resp = await http.post("/files", params={"path": str(tmp_path / "bad.txt")}, content=b"x",
                               headers={"Content-Type": "application/octet-stream", **bad})
        assert resp.status_code == 400, bad
        assert not (tmp_path / "bad.txt").exists()


async def test_ranged_download(http: httpx.AsyncClient, tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    (tmp_path / "r.bin").write_bytes(data)
    params = {"path": str(tmp_path / "r.bin")}
    for spec, (start, end) in (("bytes=0-9", (0, 10)), ("bytes=100-", (100, len(data))),
                               ("bytes=-16", (len(data) - 16, len(data))), ("bytes=10-999999", (10, len(data)))):
        resp = await http.get("/files", params=params, headers={"Range": spec})  # httpx also accepts gzip
        assert resp.status_code == 206, spec
        assert resp.content == data[start:end]
        assert resp.headers["content-range"] == f"bytes {start}-{end - 1}/{len(data)}"
    resp = await http.get("/files", params=params, headers={"Range": f"bytes={len(data)}-"})
    assert resp.status_code == 416
    resp = await http.get("/files", params=params, headers={"Range": "bytes=0-1,5-6"})  # several: whole file
    assert resp.status_code == 200 and resp.content == data


async def test_downloads_of_empty_and_large_files_are_exact_and_keep_the_connection(
        http: httpx.AsyncClient, tmp_path: Path) -> None:
    """Downloads are sent with sendfile(2) (no copy through the agent's Python): an empty file,
    one larger than the socket buffers, and the next request on the same connection."""
    (tmp_path / "empty").write_bytes(b"")
    big = os.urandom(5 * 1024 * 1024 + 17)
    (tmp_path / "big").write_bytes(big)
    for _ in range(2):
        for name, data in (("empty", b""), ("big", big)):
            resp = await http.get("/files", params={"path": str(tmp_path / name)},
                                  headers={"Accept-Encoding": "identity"})
            assert resp.status_code == 200, name
            assert resp.headers["content-length"] == str(len(data))
            assert resp.content == data, name


async def test_files_compose(http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"part{i}").write_bytes(f"<{i}>".encode() * 1000)
    body = {"source_paths": [str(tmp_path / f"part{i}") for i in range(3)], "destination": str(tmp_path / "out" / "all.bin")}
    resp = await http.post("/files/compose", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["path"] == str(tmp_path / "out" / "all.bin") and resp.json()["size"] == "9000"
    assert (tmp_path / "out" / "all.bin").read_bytes() == b"<0>" * 1000 + b"<1>" * 1000 + b"<2>" * 1000
    assert not any((tmp_path / f"part{i}").exists() for i in range(3))

    (tmp_path / "a").write_bytes(b"A")
    resp = await http.post("/files/compose", json={"source_paths": [str(tmp_path / "a"), str(tmp_path / "gone")],
                                                   "destination": str(tmp_path / "out" / "all.bin")})
    assert resp.status_code == 404
    assert (tmp_path / "a").read_bytes() == b"A", "a failed compose changes nothing"
    assert (tmp_path / "out" / "all.bin").stat().st_size == 9000
    assert (await http.post("/files/compose", json={"destination": "x"})).status_code == 400

    await client.init(sandbox_id="s", template_id="t", env_vars={}, access_token="tok")
    resp = await http.post("/files/compose", json={"source_paths": [str(tmp_path / "a")], "destination": str(tmp_path / "b")})
    assert resp.status_code == 401 and (tmp_path / "a").exists()


@pytest.mark.parametrize("chunk", [1, 5, 7, 64, 4096, 1 << 20])
async def test_multipart_bodies_survive_any_split_and_are_never_changed_after_handover(
        monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """The parser hands its buffer itself to the consumer instead of a copy (each copy of an
    upload costs as much as its write under emulation). Whatever the network's read sizes, each
    part's bytes come out exact, including look-alikes of the delimiter, and a piece already
    handed over is never touched again: the pieces are kept, not copied, and joined at the end."""
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "src" / "agentenv" / "guest"))
    monkeypatch.delitem(sys.modules, "agentlib.fsutil", raising=False)
    from agentlib.fsutil import Multipart

    # Bodies hold partial look-alikes of the delimiter (a whole one would end the part).
    first = b"start\r\n--boun" + bytes(range(256)) * 12 + b"\r\n--bou" + b"x" * 5000 + b"\r\n-"
    second = bytes(range(255, -1, -1)) * 300 + b"\r\n--boun" + b"end\r\n"
    body = (b"preamble\r\n--bound\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n" + first
            + b"\r\n--bound\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b\"\r\n\r\n" + second
            + b"\r\n--bound--\r\nepilogue")

    async def chunks():  # type: ignore[no-untyped-def]
        for i in range(0, len(body), chunk):
            yield body[i:i + chunk]

    got = []
    async for headers, part in Multipart(chunks(), "bound").parts():
        pieces = [piece async for piece in part]
        got.append((headers["content-disposition"], b"".join(pieces)))
    assert [g[1] for g in got] == [first, second]
    assert got[1][0].endswith('filename="b"')


async def test_move_is_a_rename_as_in_envd(client: EnvdClient, tmp_path: Path) -> None:
    """Move is rename(2), as envd's os.Rename: never "into" an existing directory."""
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inside").write_text("x")
    with pytest.raises(EnvdError) as err:
        await client.move(str(tmp_path / "a.txt"), str(tmp_path / "dir"))
    assert err.value.code == "internal" and "error renaming" in err.value.message
    assert (tmp_path / "a.txt").read_text() == "a" and not (tmp_path / "dir" / "a.txt").exists()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("f")
    (tmp_path / "empty").mkdir()
    entry = await client.move(str(tmp_path / "src"), str(tmp_path / "empty"))  # replaces an empty dir
    assert entry["path"] == str(tmp_path / "empty") and (tmp_path / "empty" / "f").read_text() == "f"
    entry = await client.move(str(tmp_path / "a.txt"), str(tmp_path / "new" / "b.txt"))  # parents made
    assert entry["name"] == "b.txt" and (tmp_path / "new" / "b.txt").read_text() == "a"
    with pytest.raises(EnvdError) as err:
        await client.move(str(tmp_path / "gone"), str(tmp_path / "x"))
    assert err.value.code == "not_found"
