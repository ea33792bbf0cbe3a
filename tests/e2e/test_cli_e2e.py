"""The aenv CLI against a real server and real microVMs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.framework.server import ServerProcess

AENV = [sys.executable, "-m", "agentenv.cli.main"]


def aenv(server: ServerProcess, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
    return subprocess.run([*AENV, *args], capture_output=True, text=True, env=env, input=stdin, timeout=300)


def test_cli_lifecycle(server: ServerProcess, tmp_path: Path) -> None:
    r = aenv(server, "start", "-d", "--metadata", "who=cli", "--env", "GREETING=hey")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = aenv(server, "exec", sid, "--", "sh", "-c", "echo $GREETING; echo oops >&2; exit 7")
        assert r.returncode == 7
        assert r.stdout == "hey\n" and "oops" in r.stderr
        listed = json.loads(aenv(server, "ls", "-o", "json").stdout)
        assert any(s["sandboxID"] == sid and s["metadata"] == {"who": "cli"} for s in listed)
        src = tmp_path / "up.bin"
        src.write_bytes(os.urandom(3 * 1024 * 1024))
        assert aenv(server, "upload", sid, str(src), "/home/user/up.bin").returncode == 0
        dst = tmp_path / "down.bin"
        assert aenv(server, "download", sid, "/home/user/up.bin", str(dst)).returncode == 0
        assert dst.read_bytes() == src.read_bytes()
        assert aenv(server, "timeout", sid, "120").returncode == 0
    finally:
        r = aenv(server, "rm", sid)
    assert r.returncode == 0, r.stderr
    r = aenv(server, "exec", sid, "--", "true")
    assert r.returncode == 1 and r.stderr.startswith("error:") and sid in r.stderr


def test_cli_interactive_start_runs_lines_and_cleans_up(server: ServerProcess) -> None:
    before = {s["sandboxID"] for s in json.loads(aenv(server, "ls", "-o", "json").stdout)}
    r = aenv(server, "start", stdin="echo from-the-shell\nuname -s\nexit\n")
    assert r.returncode == 0, r.stderr
    assert "from-the-shell" in r.stdout and "Linux" in r.stdout
    after = {s["sandboxID"] for s in json.loads(aenv(server, "ls", "-o", "json").stdout)}
    assert after == before


def test_cli_doctor_against_a_live_server(server: ServerProcess) -> None:
    r = aenv(server, "doctor")
    assert "tcg" in r.stdout or "kvm" in r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
