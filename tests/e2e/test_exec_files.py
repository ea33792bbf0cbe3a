"""Commands and files inside a sandbox, through the native API."""

from __future__ import annotations

import hashlib
import json
import os

import httpx

from tests.e2e.conftest import ns_addr, run
from tests.framework.server import ServerProcess


def test_exec_exit_codes_streams_env_cwd_user(api: httpx.Client, sandbox: str) -> None:
    r = run(api, sandbox, "echo out; echo err >&2; exit 3")
    assert (r["exitCode"], r["stdout"], r["stderr"]) == (3, "out\n", "err\n")
    assert run(api, sandbox, ["printf", "%s|", "a b", "c"])["stdout"] == "a b|c|"
    assert run(api, sandbox, "echo $X", envs={"X": "42"})["stdout"] == "42\n"
    assert run(api, sandbox, "echo ${X:-unset}")["stdout"] == "unset\n"  # request envs do not leak
    assert run(api, sandbox, "pwd", cwd="/tmp")["stdout"] == "/tmp\n"
    assert run(api, sandbox, "whoami")["stdout"] == "user\n"
    assert run(api, sandbox, "whoami", user="root")["stdout"] == "root\n"
    assert run(api, sandbox, "sudo -n whoami")["stdout"] == "root\n"
    # The login shell's PATH is the one Debian's /etc/profile gives each (it asks bash's $EUID).
    assert run(api, sandbox, "echo $PATH")["stdout"] == "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games\n"
    assert run(api, sandbox, "echo $PATH", user="root")["stdout"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
    assert run(api, sandbox, "sh -l -c 'echo $PATH'", user="root")["stdout"].startswith("/usr/local/sbin:")
    for tool in ("python3 --version", "curl --version", "git --version", "tput -T xterm cols"):
        assert run(api, sandbox, tool)["exitCode"] == 0, tool


def test_exec_timeout_kills_the_command(api: httpx.Client, sandbox: str) -> None:
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 30", "timeout": 1})
    assert r.status_code == 504, r.text
    assert run(api, sandbox, "pgrep -x sleep || echo none")["stdout"].strip() == "none"


def test_a_command_printing_without_end_is_cut_at_the_output_bound(api: httpx.Client, sandbox: str) -> None:
    """A non-streaming exec's answer is built in the server's memory: a command that prints
    without end (an agent's `yes`, with no timeout) is killed at 16 MiB of a stream, and the
    answer keeps what it printed up to there and says why. Before, the server collected it
    for as long as the command ran."""
    r = api.post(f"/sandboxes/{sandbox}/exec", json={"cmd": "echo to-stderr >&2; yes"}, timeout=120)
    assert r.status_code == 200, r.text
    res = r.json()
    assert len(res["stdout"]) == 16 << 20 and res["stdout"].startswith("y\ny\n")
    assert res["stderr"] == "to-stderr\n"
    assert res["exitCode"] != 0 and "stdout passed 16777216 bytes: the command was killed" in res["error"]
    assert run(api, sandbox, "pgrep -x yes || echo none")["stdout"] == "none\n"


def test_exec_streams_output_as_it_happens(api: httpx.Client, sandbox: str) -> None:
    events = []
    with api.stream("POST", f"/sandboxes/{sandbox}/exec",
                    json={"cmd": "for i in 1 2 3; do echo $i; sleep 0.2; done", "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events.append(json.loads(line))
    assert events[0]["type"] == "start" and events[0]["pid"] > 0
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == "1\n2\n3\n"
    assert events[-1]["type"] == "end" and events[-1]["exitCode"] == 0


def test_a_silent_streamed_command_keeps_its_stream_alive(api: httpx.Client, sandbox: str) -> None:
    """A command quiet for longer than the client's read timeout (20 s here, 60 s in aenv exec)
    still reaches its end: the server sends keepalive lines meanwhile, so a client can set a
    read timeout that tells a stuck server from a quiet command."""
    events = []
    with api.stream("POST", f"/sandboxes/{sandbox}/exec", json={"cmd": "sleep 22; echo done", "stream": True},
                    timeout=httpx.Timeout(30, read=20)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events.append(json.loads(line))
    assert [e["type"] for e in events if e["type"] != "keepalive"] == ["start", "stdout", "end"], events
    assert any(e["type"] == "keepalive" for e in events)
    assert events[-1]["exitCode"] == 0


def test_files_roundtrip_large_and_missing(api: httpx.Client, sandbox: str) -> None:
    data = os.urandom(20 * 1024 * 1024)
    r = api.put(f"/sandboxes/{sandbox}/files", params={"path": "/home/user/dir/big.bin"}, content=data)
    assert r.status_code == 204, r.text
    sha = hashlib.sha256(data).hexdigest()
    assert run(api, sandbox, "sha256sum /home/user/dir/big.bin")["stdout"].split()[0] == sha
    assert run(api, sandbox, "stat -c %U /home/user/dir/big.bin")["stdout"] == "user\n"
    got = api.get(f"/sandboxes/{sandbox}/files", params={"path": "/home/user/dir/big.bin"})
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == sha
    missing = api.get(f"/sandboxes/{sandbox}/files", params={"path": "/home/user/nope"})
    assert missing.status_code == 404 and "does not exist" in missing.json()["message"]
    run(api, sandbox, "echo written-inside > /tmp/in.txt")
    assert api.get(f"/sandboxes/{sandbox}/files", params={"path": "/tmp/in.txt"}).text == "written-inside\n"


def test_agent_is_restarted_and_keeps_the_sandbox_state(api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "envVars": {"KEEP": "me"}}).json()["sandboxID"]
    token = api.get(f"/sandboxes/{sid}").json()["envdAccessToken"]
    try:
        old = run(api, sid, "pgrep -f /run/agentenv/agent/agent.py", user="root")["stdout"].split()
        # Kill the agent from inside; the init restarts it. The command's stream ends with an
        # error event, since the agent that ran it is gone.
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sleep 0.2; pkill -9 -f /run/agentenv/agent/agent.py",
                                                      "user": "root", "stream": True}, timeout=10)
        assert json.loads(r.text.splitlines()[-1])["type"] == "error"
        import time
        deadline = time.monotonic() + 90  # generous: the init restarts the agent after a back-off
        while time.monotonic() < deadline:
            r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "pgrep -f /run/agentenv/agent/agent.py; echo $KEEP"})
            if r.status_code == 200 and r.json()["stdout"].split()[0] not in old:
                break
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        out = r.json()["stdout"].split()
        assert out[0] not in old and out[-1] == "me"
        # The restarted agent still requires the sandbox's access token.
        _, addr = ns_addr(server, sid)
        assert httpx.post(f"http://{addr}:49983/process.Process/List", json={}).status_code == 401
        ok = httpx.post(f"http://{addr}:49983/process.Process/List", json={}, headers={"X-Access-Token": token})
        assert ok.status_code == 200
    finally:
        api.delete(f"/sandboxes/{sid}")
