"""CLI tests that need no real server and start no VM (real-VM CLI tests live elsewhere).

Commands run in-process through typer's CliRunner; the ones that talk HTTP use the ``stub``
server from conftest.py, so request shapes, streaming and exit codes are checked over a socket.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from agentenv.cli import credentials
from agentenv.cli.context import Globals
from agentenv.cli.output import OutputFormat, choose_format

from .conftest import Answer, error

COMMANDS = ["serve", "setup", "doctor", "auth", "start", "connect", "exec", "ls", "timeout", "rm", "upload", "download",
            "pause", "resume", "snapshot", "snapshot create", "snapshot ls", "snapshot rm", "fork", "template",
            "template ls", "bench"]

SANDBOX = {"templateID": "base", "sandboxID": "sb1", "alias": "base", "startedAt": "2030-01-01T00:00:00Z",
           "endAt": "2030-01-01T00:05:00Z", "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 4096,
           "state": "running", "metadata": {"team": "rl"}, "error": None}


def ndjson(*events: dict) -> Answer:
    return Answer(200, [json.dumps(e).encode() + b"\n" for e in events], "application/x-ndjson")


# --- help and startup -------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command(aenv, command):
    res = aenv(*command.split(), "--help")
    assert res.exit_code == 0, res.output
    assert "Usage" in res.stdout


def test_root_help_lists_commands(aenv):
    res = aenv("--help")
    assert res.exit_code == 0
    for command in COMMANDS:
        assert command.split()[0] in res.stdout


def test_cli_never_imports_the_server_side():
    code = ("import sys, agentenv.cli.main; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn') "
            "or m.startswith(('agentenv.server', 'agentenv.orchestrator', 'agentenv.api'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# --- credentials --------------------------------------------------------------------------------

def test_auth_writes_a_0600_file(aenv, isolated_env, closed_port):
    url = f"http://127.0.0.1:{closed_port}"
    res = aenv("auth", "--url", url, "--key", "secret-key")
    assert res.exit_code == 0, res.output
    path = isolated_env / ".config" / "agentenv" / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"url": url, "key": "secret-key"}
    assert "could not verify" in res.stderr  # nobody listens: saved anyway, with a warning
    assert "secret-key" not in res.output


def test_auth_reads_the_key_file_of_the_data_dir(aenv, tmp_path, stub):
    data = tmp_path / "node"
    data.mkdir()
    (data / "api_key").write_text("from-file\n")
    stub.on("GET", "/templates", [])
    res = aenv("auth", "--url", stub.url, "--data-dir", str(data))
    assert res.exit_code == 0, res.output
    assert credentials.load() == {"url": stub.url, "key": "from-file"}
    assert stub.calls("GET", "/templates")[0].headers["X-API-Key"] == "from-file"
    assert "accepted the key" in res.stderr


def test_auth_without_any_key_fails_clearly(aenv, tmp_path):
    res = aenv("auth", "--data-dir", str(tmp_path / "nothing"))
    assert res.exit_code == 1
    assert res.stderr.startswith("error: no API key given")


def test_resolution_order(monkeypatch, tmp_path):
    data = Path(os.environ["AENV_DATA_DIR"])
    data.mkdir()
    (data / "api_key").write_text("k-file\n")
    assert credentials.resolve() == credentials.Credentials("http://127.0.0.1:8000", "k-file")
    credentials.save("http://saved:1", "k-saved")
    assert credentials.resolve() == credentials.Credentials("http://saved:1", "k-saved")
    assert credentials.resolve(None, "k-flag") == credentials.Credentials("http://saved:1", "k-flag")
    assert credentials.resolve("saved:1", None) == credentials.Credentials("http://saved:1", "k-saved")


def test_a_key_is_sent_only_to_the_server_it_belongs_to(monkeypatch, tmp_path):
    """The saved key is the saved server's, the data dir's key file a local server's: another
    server named with --url gets neither (it was sent the saved key)."""
    data = Path(os.environ["AENV_DATA_DIR"])
    data.mkdir()
    (data / "api_key").write_text("k-file\n")
    credentials.save("http://saved:1", "k-saved")
    assert credentials.resolve("flag:2", None) == credentials.Credentials("http://flag:2", None)
    assert credentials.resolve("https://other.example", None).key is None
    assert credentials.resolve("127.0.0.1:8001", None).key == "k-file"  # a server on this host
    assert credentials.resolve("localhost:8000", None).key == "k-file"


def test_auth_does_not_send_the_local_key_file_to_a_remote_server(aenv, isolated_env):
    data = Path(os.environ["AENV_DATA_DIR"])
    data.mkdir()
    (data / "api_key").write_text("k-file\n")
    res = aenv("auth", "--url", "http://192.0.2.99:8000")
    assert res.exit_code == 1 and res.stderr.startswith("error: no API key given"), res.stderr


def test_env_vars_act_as_global_flags(aenv, stub, monkeypatch):
    stub.on("GET", "/sandboxes", [])
    monkeypatch.setenv("AENV_URL", stub.url)
    monkeypatch.setenv("AENV_API_KEY", "k-env")
    assert aenv("ls").exit_code == 0
    assert stub.requests[-1].headers["X-API-Key"] == "k-env"


# --- output format ------------------------------------------------------------------------------

class _Ctx:
    def __init__(self, output=None):
        self.obj = Globals(output=output)

    def find_root(self):
        return self


def test_format_follows_the_terminal_unless_told():
    assert choose_format(_Ctx(), isatty=True) == "table"
    assert choose_format(_Ctx(), isatty=False) == "json"
    assert choose_format(_Ctx("json"), isatty=True) == "json"
    assert choose_format(_Ctx("json"), OutputFormat.table, isatty=False) == "table"  # command option wins


def test_ls_is_json_when_piped_and_a_table_when_asked(aenv, stub):
    stub.on("GET", "/sandboxes", [SANDBOX])
    piped = aenv("--url", stub.url, "ls")
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.stdout) == [SANDBOX]
    for args in (["ls", "-o", "table"], ["-o", "table", "ls"]):
        table = aenv("--url", stub.url, *args)
        assert table.exit_code == 0
        assert "TEMPLATE" in table.stdout and "sb1" in table.stdout and "team=rl" in table.stdout
        with pytest.raises(ValueError):
            json.loads(table.stdout)


def test_ls_sends_filters(aenv, stub):
    """Metadata filters are encoded as the E2B SDKs encode them, so values holding '=', '&'
    or '%' reach the server's parser (the API's own) whole."""
    from agentenv.api.routes.sandboxes import _parse_metadata

    stub.on("GET", "/sandboxes", [])
    res = aenv("--url", stub.url, "ls", "--state", "running,error", "-m", "a=1", "-m", "b=2",
               "-m", "url=http://x/?a=b", "-m", "q=a&b", "-m", "p=%41")
    assert res.exit_code == 0, res.stderr
    query = stub.requests[-1].query
    assert query["state"] == ["running,error"]
    assert _parse_metadata(query["metadata"]) == {"a": "1", "b": "2", "url": "http://x/?a=b", "q": "a&b", "p": "%41"}


# --- errors -------------------------------------------------------------------------------------

def test_unreachable_server_is_one_error_line(aenv, closed_port):
    res = aenv("--url", f"http://127.0.0.1:{closed_port}", "ls")
    assert res.exit_code == 1
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the AgentENV server at "), res.stderr
    assert "Traceback" not in res.output


def test_server_error_message_is_shown(aenv, stub):
    stub.on("DELETE", "/sandboxes/nope", {"code": 404, "message": "sandbox 'nope' not found"}, status=404)
    res = aenv("--url", stub.url, "rm", "nope")
    assert res.exit_code == 1
    assert "error: sandbox 'nope' not found" in res.stderr


def test_bad_key_gets_a_hint(aenv, stub):
    stub.on("GET", "/templates", {"code": 401, "message": "missing or invalid API key"}, status=401)
    res = aenv("--url", stub.url, "--key", "wrong", "template", "ls")
    assert res.exit_code == 1
    assert res.stderr.startswith("error: missing or invalid API key") and "aenv auth" in res.stderr


def test_doctor_with_the_server_unreachable(aenv, closed_port):
    res = aenv("--url", f"http://127.0.0.1:{closed_port}", "doctor")
    checks = {c["check"]: c for c in json.loads(res.stdout)}
    for name in ("root", "qemu-system-x86_64", "qemu-img", "accelerator", "/dev/shm", "guest images", "nft", "ip",
                 "server"):
        assert checks[name]["status"] in ("OK", "FAIL", "WARN"), name
        assert checks[name]["detail"]
    assert checks["server"]["status"] == "WARN" and "cannot reach" in checks["server"]["detail"]
    assert checks["guest images"]["status"] == "FAIL"  # AENV_DATA_DIR is an empty tmp dir
    assert "aenv setup" in checks["guest images"]["detail"]
    assert res.exit_code == 1
    table = aenv("--url", f"http://127.0.0.1:{closed_port}", "doctor", "-o", "table")
    assert "CHECK" in table.stdout and "WARN" in table.stdout


def test_doctor_shows_the_server_accel(aenv, stub):
    stub.on("GET", "/health", Answer(204))
    stub.on("GET", "/health/details", {"version": "0.1.0", "accel": "tcg", "accelReason": "no kvm",
                                       "sandboxes": {"running": 2}, "poolReady": 1, "poolSize": 2})
    checks = {c["check"]: c for c in json.loads(aenv("--url", stub.url, "doctor").stdout)}
    assert checks["server"]["status"] == "OK" and "accel tcg: no kvm" in checks["server"]["detail"]
    assert "2 sandboxes; warm pool 1/2" in checks["server"]["detail"]
    assert checks["API key"]["status"] == "OK"


def test_doctor_says_when_the_server_refuses_the_key(aenv, stub):
    stub.on("GET", "/health", Answer(204))
    stub.on("GET", "/health/details", error(401, "missing or invalid API key: send it in the X-API-Key header"))
    checks = {c["check"]: c for c in json.loads(aenv("--url", stub.url, "doctor").stdout)}
    assert checks["server"]["status"] == "OK"
    assert checks["API key"]["status"] == "FAIL" and "invalid API key" in checks["API key"]["detail"]


def test_root_check_message(monkeypatch):
    from agentenv.cli import doctor

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    check = doctor.check_root()
    assert check.status == "FAIL"
    assert "AgentENV needs root (CAP_NET_ADMIN) to create network namespaces" in check.detail


# --- sandboxes ----------------------------------------------------------------------------------

def test_exec_streams_output_and_exits_with_the_code(aenv, stub):
    stub.on("POST", "/sandboxes/sb1/exec", ndjson(
        {"type": "start", "pid": 7}, {"type": "stdout", "data": "hello\n"}, {"type": "stderr", "data": "oops\n"},
        {"type": "stdout", "data": "bye\n"}, {"type": "end", "exitCode": 3, "status": "exit status 3",
                                              "error": "exit status 3"}))
    res = aenv("--url", stub.url, "exec", "sb1", "-e", "A=1", "--cwd", "/tmp", "--", "sh", "-c", "exit 3")
    assert res.exit_code == 3
    assert res.stdout == "hello\nbye\n"
    assert res.stderr == "oops\n"
    body = stub.requests[-1].json()
    assert body == {"cmd": ["sh", "-c", "exit 3"], "stream": True, "timeout": 0, "envs": {"A": "1"}, "cwd": "/tmp"}


def test_exec_single_arg_is_a_shell_string_and_options_pass_through(aenv, stub):
    stub.on("POST", "/sandboxes/sb1/exec", ndjson({"type": "end", "exitCode": 0, "status": "exit status 0"}))
    assert aenv("--url", stub.url, "exec", "sb1", "ls -la | wc -l").exit_code == 0
    assert stub.requests[-1].json()["cmd"] == "ls -la | wc -l"
    assert aenv("--url", stub.url, "exec", "sb1", "ls", "-la").exit_code == 0
    assert stub.requests[-1].json()["cmd"] == ["ls", "-la"]


def test_exec_killed_by_a_signal(aenv, stub):
    stub.on("POST", "/sandboxes/sb1/exec", ndjson({"type": "end", "exitCode": -1, "status": "signal: killed",
                                                   "error": "signal: killed"}))
    res = aenv("--url", stub.url, "exec", "sb1", "sleep 100")
    assert res.exit_code == 137
    assert "signal: killed" in res.stderr


def test_exec_stream_cut_short_is_an_error(aenv, stub):
    stub.on("POST", "/sandboxes/sb1/exec", ndjson({"type": "stdout", "data": "partial"}))
    res = aenv("--url", stub.url, "exec", "sb1", "true")
    assert res.exit_code == 125 and "error: the server closed the output stream" in res.stderr


def test_exec_shows_the_error_the_server_streamed(aenv, stub):
    stub.on("POST", "/sandboxes/sb1/exec", ndjson({"type": "stdout", "data": "partial"},
                                                   {"type": "error", "message": "guest agent: lost the guest agent"}))
    res = aenv("--url", stub.url, "exec", "sb1", "true")
    assert res.exit_code == 125 and "error: guest agent: lost the guest agent" in res.stderr


def test_exec_failures_of_its_own_are_told_apart_from_the_commands_codes(aenv, stub, closed_port):
    """A script's `aenv exec ID -- grep -q x f || ...` must tell 'not found' (1) from a sandbox
    that is gone, a server that is down (125: aenv failed) and a command killed at --timeout
    (124, as timeout(1)); all were 1. A mistyped option of aenv's is a usage error (2)."""
    stub.on("POST", "/sandboxes/gone/exec", {"code": 404, "message": "sandbox 'gone' not found"}, status=404)
    res = aenv("--url", stub.url, "exec", "gone", "true")
    assert res.exit_code == 125 and "not found" in res.stderr, res.output
    res = aenv("--url", f"http://127.0.0.1:{closed_port}", "exec", "sb1", "true")
    assert res.exit_code == 125 and res.stderr.startswith("error: cannot reach"), res.output
    stub.on("POST", "/sandboxes/sb1/exec", ndjson(
        {"type": "start", "pid": 7}, {"type": "error", "message": "deadline exceeded", "code": "deadline_exceeded"}))
    res = aenv("--url", stub.url, "exec", "sb1", "-t", "5", "sleep 10")
    assert res.exit_code == 124 and "longer than its timeout" in res.stderr, res.output


def test_ctrl_c_while_a_sandbox_is_created_removes_it(aenv, stub):
    """The server goes on with a create whose client went: Ctrl-C during `aenv start` left the
    sandbox running until its timeout. The create carries an Idempotency-Key; asked again with
    it, the server answers with the sandbox once made, and aenv kills it."""
    first = threading.Event()

    def create(rec):
        if not first.is_set():
            first.set()
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            time.sleep(1.0)  # the create takes a while; Ctrl-C comes meanwhile
        return Answer(201, json.dumps({"templateID": "base", "sandboxID": "sb7"}).encode())

    stub.on("POST", "/sandboxes", create)
    stub.on("DELETE", "/sandboxes/sb7", Answer(204))
    res = aenv("--url", stub.url, "start", "base")
    assert res.exit_code == 130, res.output
    creates = stub.calls("POST", "/sandboxes")
    assert len(creates) == 2 and creates[0].headers["Idempotency-Key"] == creates[1].headers["Idempotency-Key"]
    assert stub.calls("DELETE", "/sandboxes/sb7") and "sandbox sb7 killed" in res.stderr


def test_ctrl_c_while_a_sandbox_is_forked_removes_its_children(aenv, stub):
    """As for `aenv start`: the fork carries an Idempotency-Key, and on Ctrl-C aenv asks again
    with it and kills the children the server made (a child that failed has nothing to kill)."""
    first = threading.Event()
    children = [{"sandbox": {"sandboxID": "k1"}}, {"error": {"code": 507, "message": "full"}},
                {"sandbox": {"sandboxID": "k3"}}]

    def fork(rec):
        if not first.is_set():
            first.set()
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            time.sleep(1.0)
        return Answer(201, json.dumps(children).encode())

    stub.on("POST", "/sandboxes/sb1/fork", fork)
    stub.on("DELETE", "/sandboxes/k1", Answer(204))
    stub.on("DELETE", "/sandboxes/k3", Answer(204))
    res = aenv("--url", stub.url, "fork", "sb1", "-n", "3")
    assert res.exit_code == 130, res.output
    forks = stub.calls("POST", "/sandboxes/sb1/fork")
    assert len(forks) == 2 and forks[0].headers["Idempotency-Key"] == forks[1].headers["Idempotency-Key"]
    assert stub.calls("DELETE", "/sandboxes/k1") and stub.calls("DELETE", "/sandboxes/k3")
    assert "sandbox k1 killed" in res.stderr and "sandbox k3 killed" in res.stderr


def test_start_detached_prints_the_id(aenv, stub):
    stub.on("POST", "/sandboxes", {"templateID": "py", "sandboxID": "sb9"}, status=201)
    res = aenv("--url", stub.url, "start", "py", "-d", "--timeout", "60", "--cpu", "2", "--memory", "1024",
               "-m", "team=rl", "-e", "X=1")
    assert res.exit_code == 0, res.output
    assert res.stdout == "sb9\n"
    assert stub.requests[-1].json() == {"templateID": "py", "timeout": 60, "cpuCount": 2, "memoryMB": 1024,
                                        "metadata": {"team": "rl"}, "envVars": {"X": "1"}}
    as_json = aenv("--url", stub.url, "start", "-d", "-o", "json")
    assert json.loads(as_json.stdout)["sandboxID"] == "sb9"
    assert stub.requests[-1].json() == {"templateID": "base"}


def connect_stream(*messages: dict) -> Answer:
    """A Connect server-stream answer: enveloped messages, then an end-of-stream envelope."""
    frames = [struct.pack(">BI", 0, len(b := json.dumps(m).encode())) + b for m in messages]
    return Answer(200, [*frames, struct.pack(">BI", 2, 2) + b"{}"], "application/connect+json")


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def shell_routes(stub, sid: str = "sb1", exit_code: int = 3) -> None:
    """envd as seen through the server's sandbox proxy: a shell printing hi / oops, exiting 3."""
    stub.on("POST", "/process.Process/Start", connect_stream(
        {"event": {"start": {"pid": 5}}}, {"event": {"data": {"stdout": b64("hi\n")}}},
        {"event": {"data": {"stderr": b64("oops\n")}}},
        {"event": {"end": {"exitCode": exit_code, "exited": True, "status": f"exit status {exit_code}"}}}))
    stub.on("POST", "/process.Process/StreamInput", connect_stream())
    stub.on("POST", "/process.Process/CloseStdin", {})


def test_start_pipes_stdin_to_a_shell_through_the_proxy_then_kills(aenv, stub):
    stub.on("POST", "/sandboxes", {"templateID": "base", "sandboxID": "sb1", "envdAccessToken": "tok"}, status=201)
    stub.on("DELETE", "/sandboxes/sb1", Answer(204))
    shell_routes(stub)
    res = aenv("--url", stub.url, "--key", "k", "start", input="echo hi; echo oops >&2; exit 3\n")
    assert res.exit_code == 3, res.output
    assert res.stdout == "hi\n" and "oops\n" in res.stderr
    (start,) = stub.calls("POST", "/process.Process/Start")
    assert start.headers["E2b-Sandbox-Id"] == "sb1" and start.headers["E2b-Sandbox-Port"] == "49983"
    assert start.headers["X-Access-Token"] == "tok" and "X-API-Key" not in start.headers
    message = json.loads(start.body[5:])
    assert message["process"]["cmd"] == "/bin/bash" and message["process"]["args"] == ["-l"]
    assert message["stdin"] is True and "pty" not in message
    assert len(stub.calls("DELETE", "/sandboxes/sb1")) == 1
    kept = aenv("--url", stub.url, "start", "--keep", input="")
    assert kept.exit_code == 3 and len(stub.calls("DELETE", "/sandboxes/sb1")) == 1


def test_the_sandbox_is_refreshed_while_the_shell_runs(aenv, stub, monkeypatch):
    from agentenv.cli import terminal

    monkeypatch.setattr(terminal, "REFRESH_EVERY_S", 0.05)
    stub.on("POST", "/sandboxes", {"templateID": "base", "sandboxID": "sb1"}, status=201)
    stub.on("DELETE", "/sandboxes/sb1", Answer(204))
    stub.on("POST", "/sandboxes/sb1/refreshes", Answer(204))
    shell_routes(stub)
    answer = stub.routes[("POST", "/process.Process/Start")]
    stub.on("POST", "/process.Process/Start", lambda rec: (time.sleep(0.6), answer)[1])  # a shell busy 0.6 s
    res = aenv("--url", stub.url, "start", input="")
    assert res.exit_code == 3, res.output
    refreshes = stub.calls("POST", "/sandboxes/sb1/refreshes")
    assert len(refreshes) >= 3 and refreshes[0].json() == {"duration": 300}


def test_connect_resumes_then_runs_the_shell_and_keeps_the_sandbox(aenv, stub, states):
    sid = states.add(state="paused")
    shell_routes(stub, sid, exit_code=0)
    res = aenv("--url", stub.url, "connect", sid, input="echo hi\n")
    assert res.exit_code == 0, res.output
    assert res.stdout == "hi\n"
    assert [r.json() for r in stub.calls("POST", f"/sandboxes/{sid}/connect")] == [{"timeout": 300}]
    assert states.sandboxes[sid]["state"] == "running" and not stub.calls("DELETE", f"/sandboxes/{sid}")
    missing = aenv("--url", stub.url, "connect", "nope")
    assert missing.exit_code == 1 and missing.stderr.startswith("error:")


def test_timeout_and_rm_all(aenv, stub):
    stub.on("POST", "/sandboxes/sb1/timeout", Answer(204))
    assert aenv("--url", stub.url, "timeout", "sb1", "90").exit_code == 0
    assert stub.requests[-1].json() == {"timeout": 90}
    stub.on("GET", "/sandboxes", [SANDBOX, {**SANDBOX, "sandboxID": "sb2"}])
    stub.on("DELETE", "/sandboxes/sb1", Answer(204))
    stub.on("DELETE", "/sandboxes/sb2", Answer(204))
    res = aenv("--url", stub.url, "rm", "--all")
    assert res.exit_code == 0, res.output
    assert sorted(res.stdout.split()) == ["sb1", "sb2"]
    assert aenv("rm").exit_code == 2  # neither ids nor --all: usage error


def test_upload_and_download_stream(aenv, stub, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    stub.on("PUT", "/sandboxes/sb1/files", Answer(204))
    res = aenv("--url", stub.url, "upload", "sb1", str(src), "/home/user/")
    assert res.exit_code == 0, res.output
    put = stub.requests[-1]
    assert put.query == {"path": ["/home/user/blob.bin"]}
    assert put.headers["Content-Length"] == str(len(data)) and put.body == data

    stub.on("GET", "/sandboxes/sb1/files", Answer(200, [data[:1000], data[1000:]], "application/octet-stream"))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = aenv("--url", stub.url, "download", "sb1", "/home/user/blob.bin", str(out_dir))
    assert res.exit_code == 0, res.output
    assert (out_dir / "blob.bin").read_bytes() == data
    assert [p.name for p in out_dir.iterdir()] == ["blob.bin"]  # no leftover partial file


def test_a_download_writes_through_a_link_and_into_a_fifo_never_replacing_them(aenv, stub, tmp_path):
    """A download renamed its temp file over the path given: a symlink (a dotfile kept in a
    repository) was replaced by a copy and its target left as it was; as root a device node
    (/dev/null) would be replaced by a regular file; a FIFO or /dev/fd/N failed."""
    stub.on("GET", "/sandboxes/sb1/files", Answer(200, [b"new content\n"], "application/octet-stream"))
    target = tmp_path / "repo-bashrc"
    target.write_text("old\n")
    link = tmp_path / ".bashrc"
    link.symlink_to(target)
    res = aenv("--url", stub.url, "download", "sb1", "/home/user/.bashrc", str(link))
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and target.read_text() == "new content\n"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    res = aenv("--url", stub.url, "download", "sb1", "/home/user/.bashrc", str(fifo))
    reader.join(10)
    assert res.exit_code == 0, res.output
    assert got == [b"new content\n"] and stat.S_ISFIFO(fifo.stat().st_mode)


def test_pull_prints_the_template_id_on_stdout(aenv, stub):
    stub.on("POST", "/images/pull", {"templateID": "alpine", "image": {"ref": "docker.io/library/alpine:3",
                                                                       "digest": "sha256:" + "a" * 64}})
    res = aenv("--url", stub.url, "pull", "alpine:3")
    assert res.exit_code == 0, res.output
    assert res.stdout == "alpine\n" and "aenv start alpine" in res.stderr


def test_upload_of_a_file_that_says_it_is_empty_or_grows_sends_what_it_has(aenv, stub, tmp_path):
    """/proc files report size 0, a log grows while it is read: with a fixed Content-Length
    the upload failed ('Too much data for declared Content-Length')."""
    stub.on("PUT", "/sandboxes/sb1/files", Answer(204))
    res = aenv("--url", stub.url, "upload", "sb1", "/proc/self/status", "/tmp/status")
    assert res.exit_code == 0, res.output
    assert stub.requests[-1].body.startswith(b"Name:") and "Content-Length" not in stub.requests[-1].headers
    log = tmp_path / "growing.log"
    log.write_bytes(b"x" * (8 << 20))
    writing = threading.Event()
    writing.set()

    def keep_writing() -> None:  # a program still writing its log
        with open(log, "ab") as f:
            while writing.is_set():
                f.write(b"y" * 1024)
                f.flush()

    writer = threading.Thread(target=keep_writing, daemon=True)
    writer.start()
    try:
        res = aenv("--url", stub.url, "upload", "sb1", str(log), "/tmp/log")
    finally:
        writing.clear()
        writer.join()
    body = stub.requests[-1].body
    assert res.exit_code == 0, res.output
    assert int(stub.requests[-1].headers["Content-Length"]) == len(body) >= 8 << 20
    assert res.exit_code == 0, res.output


def test_download_error_leaves_no_file(aenv, stub, tmp_path):
    stub.on("GET", "/sandboxes/sb1/files", {"code": 404, "message": "guest agent: file not found"}, status=404)
    dest = tmp_path / "x"
    res = aenv("--url", stub.url, "download", "sb1", "/nope", str(dest))
    assert res.exit_code == 1 and "error: guest agent: file not found" in res.stderr
    assert list(tmp_path.glob("*x*")) == []


# --- serve wiring -------------------------------------------------------------------------------

def test_serve_flags_override_env(aenv, monkeypatch, tmp_path):
    seen = []
    fake = types.ModuleType("agentenv.server")
    fake.serve = seen.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentenv.server", fake)
    monkeypatch.setenv("AENV_PORT", "7000")
    monkeypatch.setenv("AENV_HOST", "0.0.0.0")
    res = aenv("serve", "--port", "7001", "--data-dir", str(tmp_path / "d"))
    assert res.exit_code == 0, res.output
    (settings,) = seen
    assert (settings.host, settings.port, settings.data_dir) == ("0.0.0.0", 7001, tmp_path / "d")


def test_serve_turns_platform_errors_into_one_line(aenv, monkeypatch):
    from agentenv.errors import ProvisioningError

    def boom(_settings):
        raise ProvisioningError("no guest images under /x; run `aenv setup` first")

    fake = types.ModuleType("agentenv.server")
    fake.serve = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "agentenv.server", fake)
    res = aenv("serve")
    assert res.exit_code == 1
    assert res.stderr.startswith("starting AgentENV on http://127.0.0.1:8000")
    assert res.stderr.endswith("\nerror: no guest images under /x; run `aenv setup` first\n")
    assert "Traceback" not in res.output


def test_exec_keeps_the_commands_own_options_and_writes_its_bytes(aenv, stub):
    """After the command's first word every argument is the command's (grep's -e is not
    --env); output the server sends as surrogate escapes goes out as the original bytes."""
    stub.on("POST", "/sandboxes/sb1/exec", ndjson(
        {"type": "stdout", "data": "\udcff\udcfe-é\n"}, {"type": "end", "exitCode": 0, "status": "exit status 0"}))
    res = aenv("--url", stub.url, "exec", "sb1", "-e", "A=1", "grep", "-e", "root", "/etc/passwd")
    assert res.exit_code == 0, res.output
    assert stub.requests[-1].json()["cmd"] == ["grep", "-e", "root", "/etc/passwd"]
    assert stub.requests[-1].json()["envs"] == {"A": "1"}
    assert res.stdout_bytes == b"\xff\xfe-" + "é".encode() + b"\n"


def test_an_unusable_server_address_or_key_is_one_line_not_a_traceback(aenv):
    for args in (["--url", "http://127.0.0.1:80x"], ["--url", "http://[::1"]):
        res = aenv(*args, "ls")
        assert res.exit_code == 1 and "not usable" in res.stderr and "Traceback" not in res.output


def test_a_key_the_server_refuses_is_not_saved(aenv, isolated_env, stub):
    path = isolated_env / ".config" / "agentenv" / "credentials.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")  # a damaged file does not stop `aenv auth` from replacing it
    stub.on("GET", "/templates", {"code": 401, "message": "missing or invalid API key"}, status=401)
    res = aenv("auth", "--url", stub.url, "--key", "wrong")
    assert res.exit_code == 1 and "refused this key; nothing was saved" in res.stderr, res.output
    assert path.read_text() == "{not json"
    stub.on("GET", "/templates", [])
    assert aenv("auth", "--url", stub.url, "--key", "right").exit_code == 0
    assert json.loads(path.read_text()) == {"url": stub.url, "key": "right"}


def test_an_answer_that_is_not_json_names_the_address(aenv, stub):
    """A URL that points at another web server (it answers HTML), or a body cut short."""
    stub.on("GET", "/sandboxes", Answer(200, b"<html>welcome</html>", content_type="text/html"))
    res = aenv("--url", stub.url, "ls")
    assert res.exit_code == 1 and "text/html, not JSON" in res.stderr and "Traceback" not in res.output
    stub.on("POST", "/sandboxes", Answer(201, b'{"sandboxID": "sb'))
    res = aenv("--url", stub.url, "start", "-d")
    assert res.exit_code == 1 and "broken JSON" in res.stderr, res.output
    stub.on("DELETE", "/sandboxes/x", Answer(500, b'["not", "an", "object"]'))
    res = aenv("--url", stub.url, "rm", "x")
    assert res.exit_code == 1 and "error: ['not', 'an', 'object']" in res.stderr, res.output


def test_exec_refuses_an_option_it_does_not_have_before_the_command(aenv, stub):
    for args in (["exec", "sb1", "--bogus", "ls"], ["exec", "-iq", "sb1", "ls"]):
        res = aenv("--url", stub.url, *args)
        assert res.exit_code == 2 and res.stderr.startswith("error: no such option"), res.output
    assert not stub.requests, "nothing was run"
    assert "Usage: aenv exec" in aenv("exec", "sb1", "-h").stdout


def test_rm_all_does_not_fail_for_a_sandbox_gone_meanwhile(aenv, stub):
    stub.on("GET", "/sandboxes", [SANDBOX, {**SANDBOX, "sandboxID": "sb2"}])
    stub.on("DELETE", "/sandboxes/sb1", Answer(204))
    stub.on("DELETE", "/sandboxes/sb2", {"code": 404, "message": "sandbox 'sb2' not found"}, status=404)
    res = aenv("--url", stub.url, "rm", "--all")
    assert res.exit_code == 0, res.output
    res = aenv("--url", stub.url, "rm", "sb2")  # named: its absence is an error
    assert res.exit_code == 1 and "not found" in res.stderr


def test_snapshot_ls_follows_the_pages(aenv, stub):
    snap = {"snapshotID": "s1", "names": ["one"], "sandboxID": "sb1", "createdAt": "2026-01-01T00:00:00Z"}

    def pages(rec):
        token = rec.query.get("nextToken", [None])[0]
        if token is None:
            return Answer(200, json.dumps([snap]).encode(), headers={"X-Next-Token": "t1"})
        return Answer(200, json.dumps([{**snap, "snapshotID": "s2"}]).encode())

    stub.on("GET", "/snapshots", pages)
    res = aenv("--url", stub.url, "snapshot", "ls", "-o", "json")
    assert res.exit_code == 0, res.output
    assert [s["snapshotID"] for s in json.loads(res.stdout)] == ["s1", "s2"]


def test_version(aenv):
    res = aenv("--version")
    assert res.exit_code == 0 and res.stdout.startswith("aenv ")


def test_template_build_with_a_missing_copy_source_reserves_nothing(aenv, stub, tmp_path):
    (tmp_path / "aenv.Dockerfile").write_text("FROM base\nCOPY nothere /app/\n")
    res = aenv("--url", stub.url, "template", "build", str(tmp_path), "--name", "t")
    assert res.exit_code == 1 and res.stderr.startswith("error:") and "nothere" in res.stderr, res.output
    assert stub.requests == [], "no build was reserved on the server"
    (tmp_path / "aenv.Dockerfile").write_bytes(b"FROM base\nRUN echo \xff\n")
    res = aenv("--url", stub.url, "template", "build", str(tmp_path), "--name", "t")
    assert res.exit_code == 1 and "not a UTF-8 text file" in res.stderr, res.output
