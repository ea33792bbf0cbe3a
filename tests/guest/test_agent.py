"""End-to-end tests of the guest agent (src/agentenv/guest/agent.py) through EnvdClient and raw HTTP.

The agent runs as a real subprocess (see conftest.py). Raw httpx is used where the test is about
wire details: status codes, Connect envelopes, error bodies.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import pwd
import re
import struct
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from agentenv.envd_client import CommandResult, EnvdClient, EnvdError, EnvdUnavailable

pytestmark = pytest.mark.timeout(120)

CONNECT_JSON = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}


def envelope(obj: object, flags: int = 0) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(data)) + data


def parse_envelopes(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, length = struct.unpack(">BI", body[:5])
        assert len(body) >= 5 + length, "truncated envelope"
        out.append((flags, json.loads(body[5:5 + length])))
        body = body[5 + length:]
    return out


async def raw_stream(http: httpx.AsyncClient, method: str, body: bytes,
                     headers: dict[str, str] | None = None) -> tuple[int, list[tuple[int, dict]]]:
    resp = await http.post(f"/{method}", content=body, headers={**CONNECT_JSON, **(headers or {})})
    return resp.status_code, parse_envelopes(resp.content) if resp.status_code == 200 else []


def agent_children(agent_pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every direct child of the agent, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat_line.rsplit(")", 1)[1].split()
            if int(fields[1]) == agent_pid:
                children.append((int(entry), fields[0]))
    return children


# ---------------------------------------------------------------------------------------------
# Health, init, auth
# ---------------------------------------------------------------------------------------------


async def test_health_is_204(http: httpx.AsyncClient, client: EnvdClient) -> None:
    resp = await http.get("/health")
    assert resp.status_code == 204
    assert resp.content == b""
    assert await client.health() is True


async def test_health_false_and_wait_healthy_times_out_when_nothing_listens() -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = EnvdClient(f"http://127.0.0.1:{port}")
    try:
        assert await c.health(timeout=0.2) is False
        start = time.monotonic()
        with pytest.raises(EnvdUnavailable, match="did not become healthy"):
            await c.wait_healthy(0.5)
        assert time.monotonic() - start < 3
    finally:
        await c.aclose()


async def test_init_sets_env_and_marker_files(agent, client: EnvdClient) -> None:
    await client.init(sandbox_id="sbx1", template_id="tpl1", env_vars={"MY_VAR": "v1"}, access_token=None)
    result = await client.run('echo "$MY_VAR|$E2B_SANDBOX|$E2B_SANDBOX_ID|$E2B_TEMPLATE_ID"')
    assert result.exit_code == 0, result
    assert result.stdout == b"v1|true|sbx1|tpl1\n"
    assert (agent.run_dir / ".E2B_SANDBOX").read_text() == "true"
    assert (agent.run_dir / ".E2B_SANDBOX_ID").read_text() == "sbx1"
    assert (agent.run_dir / ".E2B_TEMPLATE_ID").read_text() == "tpl1"

    # /init is idempotent and is repeated after each snapshot restore with a new identity.
    await client.init(sandbox_id="sbx2", template_id="tpl1", env_vars={"OTHER": "o"}, access_token=None)
    result = await client.run(["/bin/sh", "-c", 'echo "$MY_VAR|$OTHER|$E2B_SANDBOX_ID"'])
    assert result.stdout == b"v1|o|sbx2\n"
    assert (agent.run_dir / ".E2B_SANDBOX_ID").read_text() == "sbx2"


async def test_init_rejects_bad_json(http: httpx.AsyncClient) -> None:
    resp = await http.post("/init", content=b"{nope")
    assert resp.status_code == 400
    assert resp.json()["code"] == 400
    assert (await http.get("/health")).status_code == 204


async def test_access_token_enforced(agent, http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    await client.init(sandbox_id="s", template_id="t", env_vars={}, access_token="sekret")
    stat_body = json.dumps({"path": "/"}).encode()
    json_headers = {"Content-Type": "application/json"}

    resp = await http.post("/filesystem.Filesystem/Stat", content=stat_body, headers=json_headers)
    assert resp.status_code == 401
    assert resp.json()["code"] == 401 and resp.json()["message"]
    resp = await http.post("/filesystem.Filesystem/Stat", content=stat_body,
                           headers={**json_headers, "X-Access-Token": "wrong"})
    assert resp.status_code == 401
    resp = await http.post("/filesystem.Filesystem/Stat", content=stat_body,
                           headers={**json_headers, "X-Access-Token": "sekret"})
    assert resp.status_code == 200 and resp.json()["entry"]["path"] == "/"
    status, _ = await raw_stream(http, "process.Process/Start",
                                 envelope({"process": {"cmd": "/bin/true"}}))
    assert status == 401

    # Exempt: /health. The client picked the token up from init() and keeps working.
    assert (await http.get("/health")).status_code == 204
    assert (await client.run(["/bin/echo", "ok"])).stdout == b"ok\n"

    # /files: a valid header token, or a valid signature; a wrong header token is refused.
    target = tmp_path / "secret.txt"
    target.write_bytes(b"s3")
    params = {"path": str(target)}
    assert (await http.get("/files", params=params)).status_code == 401
    assert (await http.get("/files", params=params, headers={"X-Access-Token": "bad"})).status_code == 401
    resp = await http.get("/files", params=params, headers={"X-Access-Token": "sekret"})
    assert resp.status_code == 200 and resp.content == b"s3"
    raw = f"{target}:read::sekret".encode()
    signature = "v1_" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")
    resp = await http.get("/files", params={**params, "signature": signature})
    assert resp.status_code == 200 and resp.content == b"s3"
    resp = await http.get("/files", params={**params, "signature": signature},
                          headers={"X-Access-Token": "bad"})
    assert resp.status_code == 401
    expired = int(time.time()) - 10
    raw = f"{target}:read::sekret:{expired}".encode()
    signature = "v1_" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")
    resp = await http.get("/files", params={**params, "signature": signature, "signature_expiration": expired})
    assert resp.status_code == 401 and "expired" in resp.json()["message"]

    anonymous = EnvdClient(agent.url)
    try:
        with pytest.raises(EnvdError) as err:
            await anonymous.run("true")
        assert err.value.code == "unauthenticated"
    finally:
        await anonymous.aclose()


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


async def test_echo_streams_start_stdout_end(client: EnvdClient) -> None:
    events = [e async for e in client.stream("echo hi")]
    assert events[0].type == "start" and events[0].pid > 0
    assert b"".join(e.data for e in events if e.type == "stdout") == b"hi\n"
    assert events[-1].type == "end"
    assert events[-1].exit_code == 0 and events[-1].exited and events[-1].status == "exit status 0"
    assert events[-1].error is None

    seen: list[bytes] = []
    result = await client.run("echo hi", on_stdout=seen.append)
    assert result == CommandResult(0, b"hi\n", b"", result.pid, None)
    assert b"".join(seen) == b"hi\n"


def _connections_to(port: int) -> set[int]:
    """Local ports of the established TCP connections to ``port`` on 127.0.0.1."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "01" and int(remote.split(":")[1], 16) == port:
            out.add(int(local.split(":")[1], 16))
    return out


async def test_commands_reuse_one_connection(agent, client: EnvdClient) -> None:
    """A command's stream is read to its end, so the next command goes over the same
    connection: opening one into an emulated guest costs more than a short command."""
    port = int(agent.url.rsplit(":", 1)[1])
    await client.run("true")
    first = _connections_to(port)
    for _ in range(3):
        assert (await client.run("echo x")).stdout == b"x\n"
        assert _connections_to(port) == first
    assert len(first) == 1


async def test_raw_start_stream_framing(http: httpx.AsyncClient) -> None:
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "printf abc; exit 3"]}, "stdin": False})
    status, frames = await raw_stream(http, "process.Process/Start", body)
    assert status == 200
    assert [f for f, _ in frames] == [0] * (len(frames) - 1) + [2]
    assert frames[0][1] == {"event": {"start": {"pid": frames[0][1]["event"]["start"]["pid"]}}}
    assert {"event": {"data": {"stdout": base64.b64encode(b"abc").decode()}}} in [m for _, m in frames]
    assert frames[-2][1] == {"event": {"end": {"exitCode": 3, "exited": True, "status": "exit status 3",
                                               "error": "exit status 3"}}}
    assert frames[-1][1] == {}


async def test_nonzero_exit_and_stderr(client: EnvdClient) -> None:
    result = await client.run("echo out; echo oops >&2; exit 7")
    assert result.exit_code == 7
    assert result.error == "exit status 7"
    assert result.stdout == b"out\n"
    assert result.stderr == b"oops\n"


async def test_large_output_is_chunked_and_complete(http: httpx.AsyncClient, client: EnvdClient) -> None:
    result = await client.run(["/bin/sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x"])
    assert result.stdout == b"x" * 300000
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "head -c 100000 /dev/zero"]}})
    _, frames = await raw_stream(http, "process.Process/Start", body)
    chunks = [base64.b64decode(m["event"]["data"]["stdout"]) for _, m in frames if "data" in m.get("event", {})]
    assert sum(map(len, chunks)) == 100000
    assert max(map(len, chunks)) <= 32 * 1024


async def test_argv_form_has_no_shell(client: EnvdClient) -> None:
    result = await client.run(["/bin/echo", "a  b", "$HOME"])
    assert result.stdout == b"a  b $HOME\n"


async def test_cwd(client: EnvdClient, tmp_path: Path) -> None:
    result = await client.run("pwd", cwd=str(tmp_path))
    assert result.stdout.decode().strip() == str(tmp_path)
    with pytest.raises(EnvdError) as err:
        await client.run("pwd", cwd=str(tmp_path / "missing"))
    assert err.value.code == "invalid_argument"


async def test_request_envs_do_not_leak(client: EnvdClient) -> None:
    result = await client.run(["/bin/sh", "-c", "echo $REQ_ONLY"], envs={"REQ_ONLY": "x1"})
    assert result.stdout == b"x1\n"
    result = await client.run(["/bin/sh", "-c", "echo ${REQ_ONLY:-unset}"])
    assert result.stdout == b"unset\n"


async def test_process_environment_basics(client: EnvdClient) -> None:
    result = await client.run(["/bin/sh", "-c", 'echo "$HOME|$USER|$LOGNAME"; test -n "$PATH"'])
    home = pwd.getpwuid(os.geteuid()).pw_dir
    name = pwd.getpwuid(os.geteuid()).pw_name
    assert result.exit_code == 0
    assert result.stdout == f"{home}|{name}|{name}\n".encode()


async def test_timeout_kills_process_with_deadline_exceeded(client: EnvdClient, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    start = time.monotonic()
    with pytest.raises(EnvdError) as err:
        await client.run(["/bin/sh", "-c", f"sleep 2; touch {marker}"], timeout=0.5)
    assert err.value.code == "deadline_exceeded"
    assert time.monotonic() - start < 1.8
    await asyncio.sleep(2.3)
    assert not marker.exists(), "the timed-out command (and its child sleep) must have been killed"
    assert await client.list_processes() == []


async def test_a_timeout_kills_the_process_groups_that_left_the_commands_own(client: EnvdClient,
                                                                              tmp_path: Path) -> None:
    """GNU ``timeout`` puts itself in a process group of its own (a PTY shell does so for each
    job): killing the command's group alone left ``cd repo && timeout 600 pytest`` running
    for its ten minutes after the command's own timeout."""
    marker = tmp_path / "marker"
    with pytest.raises(EnvdError) as err:
        await client.run(["/bin/bash", "-c", f"timeout 100 sh -c 'sleep 2; touch {marker}'; echo after"], timeout=0.5)
    assert err.value.code == "deadline_exceeded"
    await asyncio.sleep(2.5)
    assert not marker.exists(), "the command's timeout left what `timeout` started running"


async def test_user_switching(client: EnvdClient) -> None:
    result = await client.run(["id", "-un"], user="nobody")
    assert result.exit_code == 0, result
    assert result.stdout == b"nobody\n"
    result = await client.run(["/bin/sh", "-c", "echo $HOME $USER"], user="nobody")
    assert result.stdout == f"{pwd.getpwnam('nobody').pw_dir} nobody\n".encode()


async def test_unknown_user_is_unauthenticated(client: EnvdClient) -> None:
    with pytest.raises(EnvdError) as err:
        await client.run("true", user="no-such-user-xyz")
    assert err.value.code == "unauthenticated"
    assert "invalid username" in err.value.message


async def test_a_user_added_or_removed_after_a_lookup_is_seen_at_once(client: EnvdClient) -> None:
    """The agent keeps user lookups (each costs milliseconds under TCG) only while /etc/passwd
    and /etc/group are unchanged: useradd and userdel take effect on the next command."""
    name = "aenv-cache-probe"
    subprocess.run(["userdel", name], capture_output=True, check=False)
    with pytest.raises(EnvdError):
        await client.run(["id", "-un"], user=name)
    try:
        subprocess.run(["useradd", "-M", name], check=True)
        assert (await client.run(["id", "-un"], user=name)).stdout == f"{name}\n".encode()
        subprocess.run(["groupadd", name + "-g"], check=True)
        subprocess.run(["usermod", "-aG", name + "-g", name], check=True)
        assert name + "-g" in (await client.run(["id", "-Gn"], user=name)).stdout.decode().split()
    finally:
        subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", name + "-g"], capture_output=True, check=False)
    with pytest.raises(EnvdError):
        await client.run(["id", "-un"], user=name)


async def test_stdin_send_input_and_close(client: EnvdClient) -> None:
    events = client.stream(["cat"], stdin=True)
    start = await events.__anext__()
    assert start.type == "start"
    await client.send_stdin(start.pid, b"hello stdin\n")
    await client.close_stdin(start.pid)
    rest = [e async for e in events]
    assert b"".join(e.data for e in rest if e.type == "stdout") == b"hello stdin\n"
    assert rest[-1].type == "end" and rest[-1].exit_code == 0


async def test_stdin_false_reads_dev_null(client: EnvdClient) -> None:
    result = await asyncio.wait_for(client.run(["cat"]), 10)  # run() sends stdin=false
    assert result.exit_code == 0 and result.stdout == b""


async def test_list_send_signal_and_disconnect_survival(client: EnvdClient) -> None:
    stream = client.stream(["sleep", "30"], tag="bg")
    start = await stream.__anext__()
    await stream.aclose()  # client disconnect must not kill the process
    await asyncio.sleep(0.3)
    listed = await client.list_processes()
    assert [p["pid"] for p in listed] == [start.pid]
    assert listed[0]["config"] == {"cmd": "sleep", "args": ["30"]}
    assert listed[0]["tag"] == "bg"
    os.kill(start.pid, 0)  # still alive

    assert await client.send_signal(start.pid, "SIGKILL") is True
    for _ in range(50):
        if not await client.list_processes():
            break
        await asyncio.sleep(0.1)
    assert await client.list_processes() == []
    assert await client.send_signal(start.pid) is False  # not running any more -> not_found
    assert await client.send_signal(999999) is False

    # A late Connect still sees how it ended.
    events = [e async for e in client.connect(start.pid)]
    assert [e.type for e in events] == ["start", "end"]
    assert events[-1].exit_code == -1 and events[-1].status == "signal: killed" and not events[-1].exited


async def test_connect_receives_remaining_output(client: EnvdClient) -> None:
    stream = client.stream(["/bin/sh", "-c", "sleep 0.5; echo late; exit 4"])
    start = await stream.__anext__()
    await stream.aclose()
    events = [e async for e in client.connect(start.pid)]
    assert events[0].type == "start" and events[0].pid == start.pid
    assert b"".join(e.data for e in events if e.type == "stdout") == b"late\n"
    assert events[-1].type == "end" and events[-1].exit_code == 4
    with pytest.raises(EnvdError) as err:
        [e async for e in client.connect(999999)]
    assert err.value.code == "not_found"


async def test_sigterm_via_send_signal(client: EnvdClient) -> None:
    stream = client.stream(["sleep", "30"])
    start = await stream.__anext__()
    assert await client.send_signal(start.pid, "SIGTERM") is True
    rest = [e async for e in stream]
    assert rest[-1].type == "end" and rest[-1].exit_code == -1 and rest[-1].status == "signal: terminated"


async def test_keepalive_events(http: httpx.AsyncClient) -> None:
    body = envelope({"process": {"cmd": "sleep", "args": ["1"]}})
    _, frames = await raw_stream(http, "process.Process/Start", body, {"Keepalive-Ping-Interval": "0.2"})
    keepalives = [m for _, m in frames if m == {"event": {"keepalive": {}}}]
    assert len(keepalives) >= 2
    assert "end" in frames[-2][1]["event"]


async def test_pty_process(http: httpx.AsyncClient) -> None:
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "stty size; tty"]},
                     "pty": {"size": {"cols": 100, "rows": 30}}})
    status, frames = await raw_stream(http, "process.Process/Start", body)
    assert status == 200
    output = b"".join(base64.b64decode(m["event"]["data"]["pty"]) for _, m in frames
                      if "data" in m.get("event", {}))
    assert b"30 100" in output
    assert b"/dev/pts/" in output
    assert frames[-2][1]["event"]["end"]["exited"] is True


async def test_background_child_holding_pipes_does_not_block_end(client: EnvdClient) -> None:
    start = time.monotonic()
    result = await client.run(["/bin/sh", "-c", "sleep 5 & echo started"])
    assert result.exit_code == 0 and result.stdout == b"started\n"
    assert time.monotonic() - start < 3.5


async def test_orphans_are_reaped(agent, client: EnvdClient) -> None:
    # The shell exits at once; its background children are re-parented to the (subreaper) agent.
    start = time.monotonic()
    result = await client.run(["/bin/sh", "-c", "(sleep 1 &) >/dev/null 2>&1; sleep 1 >/dev/null 2>&1 & exit 0"])
    assert result.exit_code == 0
    assert time.monotonic() - start < 0.9, "pipes closed by the children: run() must not wait for them"
    adopted = [pid for pid, _ in agent_children(agent.pid)]
    assert len(adopted) == 2, "orphans should be re-parented to the agent (PR_SET_CHILD_SUBREAPER)"
    await asyncio.sleep(2)
    assert [pid for pid, _ in agent_children(agent.pid) if pid in adopted] == [], "orphans were not reaped"


# ---------------------------------------------------------------------------------------------
# Connect protocol errors
# ---------------------------------------------------------------------------------------------


async def test_malformed_envelope_is_invalid_argument(http: httpx.AsyncClient) -> None:
    for body in (b"\x00\x00", b"\x00\x00\x00\x00\x10{}", envelope({"process": 5})[:-1] + b"x", b"garbage!"):
        status, frames = await raw_stream(http, "process.Process/Start", body)
        assert status == 200
        assert frames[-1][0] == 2
        assert frames[-1][1]["error"]["code"] == "invalid_argument", (body, frames)
    status, frames = await raw_stream(http, "process.Process/Start", envelope({"process": {}}))
    assert frames[-1][1]["error"]["code"] == "invalid_argument"

    resp = await http.post("/filesystem.Filesystem/Stat", content=b"{not json",
                           headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["code"] == "invalid_argument"
    resp = await http.post("/filesystem.Filesystem/Stat", content=b"[1]",
                           headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert (await http.get("/health")).status_code == 204


async def test_unknown_rpc_is_unimplemented(http: httpx.AsyncClient) -> None:
    for path in ("/process.Process/Frobnicate", "/filesystem.Filesystem/Frobnicate", "/foo.Bar/Baz"):
        resp = await http.post(path, content=b"{}", headers={"Content-Type": "application/json"})
        assert resp.status_code == 501
        assert resp.json()["code"] == "unimplemented"
    assert (await http.get("/nope")).status_code == 404
    assert (await http.get("/health")).status_code == 204


async def test_keep_alive_connection_reuse(agent) -> None:
    # Several requests on one connection, including a chunked request body.
    async with httpx.AsyncClient(base_url=agent.url,
                                 limits=httpx.Limits(max_connections=1)) as http:
        async def chunked():
            body = envelope({"process": {"cmd": "/bin/echo", "args": ["x"]}})
            yield body[:3]
            yield body[3:]

        for _ in range(3):
            resp = await http.post("/process.Process/Start", content=chunked(), headers=CONNECT_JSON)
            assert parse_envelopes(resp.content)[-1] == (2, {})
            assert (await http.get("/health")).status_code == 204


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


async def test_write_then_read_file(client: EnvdClient, tmp_path: Path) -> None:
    target = tmp_path / "new" / "dir" / "a.txt"
    await client.write_file(str(target), b"hello\n")
    assert target.read_bytes() == b"hello\n"
    assert await client.read_file(str(target)) == b"hello\n"
    assert stat_mode(target) == 0o644
    assert stat_mode(target.parent) == 0o755
    await client.write_file(str(target), b"replaced")
    assert await client.read_file(str(target)) == b"replaced"
    assert [p.name for p in target.parent.iterdir()] == ["a.txt"], "no temp files left behind"

    owned = tmp_path / "nobody-dir" / "n.txt"
    await client.write_file(str(owned), b"x", user="nobody")
    nobody = pwd.getpwnam("nobody")
    assert owned.stat().st_uid == nobody.pw_uid
    assert owned.parent.stat().st_uid == nobody.pw_uid


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


async def test_large_file_roundtrip_is_streamed(agent, client: EnvdClient, tmp_path: Path) -> None:
    size, chunk = 50 * 1024 * 1024, 1024 * 1024
    sent_hash = hashlib.sha256()

    async def produce():
        for _ in range(size // chunk):
            data = os.urandom(chunk)
            sent_hash.update(data)
            yield data

    def peak_rss_kib() -> int:
        status = Path(f"/proc/{agent.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+)", status).group(1))

    before = peak_rss_kib()
    target = tmp_path / "big.bin"
    await client.write_file(str(target), produce())
    assert target.stat().st_size == size
    got_hash, got = hashlib.sha256(), 0
    async for part in client.download(str(target)):
        got_hash.update(part)
        got += len(part)
    assert got == size
    assert got_hash.hexdigest() == sent_hash.hexdigest()
    assert hashlib.sha256(target.read_bytes()).hexdigest() == sent_hash.hexdigest()
    grown_mib = (peak_rss_kib() - before) / 1024
    assert grown_mib < 30, f"agent peak RSS grew by {grown_mib:.0f} MiB: it buffered the file"


async def test_multipart_upload(http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    target = tmp_path / "m" / "a.txt"
    resp = await http.post("/files", params={"path": str(target)},
                           files={"file": ("whatever.txt", b"multi\r\n--part", "application/octet-stream")})
    assert resp.status_code == 200, resp.text
    assert resp.json() == [{"path": str(target), "name": "a.txt", "type": "file"}]
    assert target.read_bytes() == b"multi\r\n--part"

    one, two = tmp_path / "w" / "1.txt", tmp_path / "w" / "sub" / "2.txt"
    resp = await http.post("/files", files=[("file", (str(one), b"one")), ("file", (str(two), b"two" * 50000))])
    assert resp.status_code == 200, resp.text
    assert [item["path"] for item in resp.json()] == [str(one), str(two)]
    assert one.read_bytes() == b"one" and two.read_bytes() == b"two" * 50000


async def test_missing_file_and_directory_errors(http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    resp = await http.get("/files", params={"path": str(missing)})
    assert resp.status_code == 404
    assert resp.json() == {"code": 404, "message": f"path '{missing}' does not exist"}
    with pytest.raises(EnvdError) as err:
        await client.read_file(str(missing))
    assert err.value.code == "not_found"
    resp = await http.get("/files", params={"path": str(tmp_path)})
    assert resp.status_code == 400
    resp = await http.post("/files", params={"path": str(tmp_path)}, content=b"x",
                           headers={"Content-Type": "application/octet-stream"})
    assert resp.status_code == 400
    resp = await http.get("/files", params={"path": str(missing), "username": "no-such-user-xyz"})
    assert resp.status_code == 401


async def test_relative_paths_resolve_against_home(client: EnvdClient) -> None:
    name = f"aenv-test-{os.getpid()}-{time.monotonic_ns()}.txt"
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    try:
        await client.write_file(name, b"rel")
        assert (home / name).read_bytes() == b"rel"
        assert (await client.stat(f"~/{name}"))["path"] == str(home / name)
    finally:
        (home / name).unlink(missing_ok=True)


async def test_upload_disk_full_is_507_without_partial_file(client: EnvdClient, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)  # tests run as root
    try:
        with pytest.raises(EnvdError) as err:
            await client.write_file(str(small / "big.bin"), b"z" * (3 * 1024 * 1024))
        assert err.value.status == 507
        assert err.value.code == "resource_exhausted"
        assert list(small.iterdir()) == []
        await client.write_file(str(small / "ok.txt"), b"fits")  # the agent still serves uploads
        assert (small / "ok.txt").read_bytes() == b"fits"
    finally:
        subprocess.run(["umount", str(small)], check=False)


async def test_filesystem_rpcs(client: EnvdClient, tmp_path: Path) -> None:
    root = tmp_path / "fs"
    assert await client.make_dir(str(root / "sub1" / "deep")) is True
    assert await client.make_dir(str(root / "sub1" / "deep")) is False
    (root / "file1.txt").write_bytes(b"hello")
    (root / "sub2").mkdir()
    (root / "sub1" / "x.txt").write_bytes(b"")
    os.symlink("file1.txt", root / "link")

    entry = await client.stat(str(root / "file1.txt"))
    assert entry["name"] == "file1.txt" and entry["path"] == str(root / "file1.txt")
    assert entry["type"] == "FILE_TYPE_FILE"
    assert entry["size"] == "5" and entry["mode"] == 0o644 and entry["permissions"] == "-rw-r--r--"
    assert entry["owner"] == "root" and entry["group"] == "root"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", entry["modifiedTime"])
    assert "size" not in await client.stat(str(root / "sub1" / "x.txt"))  # proto3 omits defaults

    d = await client.stat(str(root / "sub2"))
    assert d["type"] == "FILE_TYPE_DIRECTORY" and d["permissions"].startswith("d") and d["mode"] == 0o755
    link = await client.stat(str(root / "link"))
    assert link["type"] == "FILE_TYPE_FILE"
    assert link["symlinkTarget"] == str(root / "file1.txt")
    assert link["permissions"].startswith("L")

    names = [e["name"] for e in await client.list_dir(str(root))]
    assert names == ["file1.txt", "link", "sub1", "sub2"]
    paths = [e["path"] for e in await client.list_dir(str(root), depth=2)]
    assert paths == [str(root / p) for p in ("file1.txt", "link", "sub1", "sub1/deep", "sub1/x.txt", "sub2")]
    with pytest.raises(EnvdError) as err:
        await client.list_dir(str(root / "missing"))
    assert err.value.code == "not_found"

    moved = await client.move(str(root / "file1.txt"), str(root / "sub2" / "renamed.txt"))
    assert moved["path"] == str(root / "sub2" / "renamed.txt")
    assert (root / "sub2" / "renamed.txt").read_bytes() == b"hello"
    with pytest.raises(EnvdError) as err:
        await client.move(str(root / "file1.txt"), str(root / "x"))
    assert err.value.code == "not_found"

    await client.remove(str(root / "sub1"))
    assert not (root / "sub1").exists()
    await client.remove(str(root / "does-not-exist"))  # not an error
    with pytest.raises(EnvdError) as err:
        await client.stat(str(root / "sub1"))
    assert err.value.code == "not_found"


async def test_empty_file_downloads_as_an_empty_200(agent, client) -> None:
    await client.write_file("/tmp/aenv-empty-file", b"")
    r = httpx.get(agent.url + "/files", params={"path": "/tmp/aenv-empty-file"}, timeout=10)
    assert r.status_code == 200 and r.content == b""


# ---------------------------------------------------------------------------------------------
# Packaging: the image gets every module of the agent
# ---------------------------------------------------------------------------------------------


def test_image_layout_of_the_agent_runs_on_its_own(tmp_path: Path) -> None:
    from agentenv.images.toolsdrive import guest_files

    files = guest_files()
    src = Path(__file__).resolve().parents[2] / "src" / "agentenv" / "guest"
    modules = sorted(p.name for p in (src / "agentlib").glob("*.py"))
    assert sorted(k.rsplit("/", 1)[1] for k in files if k.startswith("agent/agentlib/")) == modules
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    # Run the copied tree as the guest's init does, with no PYTHONPATH: the agent must need nothing
    # but its own files.
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-u", str(tmp_path / "agent/agent.py"), "--help"],
                         capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert "envd-compatible" in out.stdout
