"""The aenv CLI against a real server and real microVMs."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx

from tests.e2e.conftest import run
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
    assert r.returncode == 125 and r.stderr.startswith("error:") and sid in r.stderr  # aenv's failure, not the command's


def sandbox_ids(server: ServerProcess) -> set[str]:
    return {s["sandboxID"] for s in json.loads(aenv(server, "ls", "-o", "json").stdout)}


def test_cli_start_with_piped_stdin_runs_it_as_a_script_and_cleans_up(server: ServerProcess) -> None:
    before = sandbox_ids(server)
    r = aenv(server, "start", stdin="cd /tmp\necho hi $PWD; uname -s\necho oops >&2; exit 3\necho never\n")
    assert r.returncode == 3, r.stderr
    assert r.stdout == "hi /tmp\nLinux\n"  # one shell: `cd` carries over; no prompt, no echo
    assert "oops" in r.stderr and "killed" in r.stderr
    assert sandbox_ids(server) == before


# The shell's prompt at the end of the output: readline may follow it with an erase to the end of
# the line (ESC [ K) when it redraws the line, which changes nothing on the screen.
PROMPT = r"[$#] (?:\x1b\[K)?$"


class Terminal:
    """``aenv`` run on a real pseudo-terminal, as a user's terminal emulator would run it."""

    def __init__(self, server: ServerProcess, *args: str, cols: int = 100, rows: int = 30) -> None:
        self.master, self.slave = os.openpty()
        self.resize(cols, rows)
        self.cooked = termios.tcgetattr(self.slave)
        env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key, "TERM": "xterm"}
        self.proc = subprocess.Popen([*AENV, *args], stdin=self.slave, stdout=self.slave, stderr=self.slave,
                                     env=env, start_new_session=True)
        self.out = b""

    def resize(self, cols: int, rows: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def expect(self, pattern: str, timeout: float = 60.0, since: int = 0) -> re.Match[bytes]:
        """Wait until ``pattern`` shows up in the output (from offset ``since``)."""
        deadline = time.monotonic() + timeout
        while not (m := re.compile(pattern.encode()).search(self.out, since)):
            left = deadline - time.monotonic()
            assert left > 0, f"{pattern!r} not seen; output so far: {self.out[-2000:]!r}"
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    self.out += os.read(self.master, 65536)
                except OSError:  # EIO: aenv exited and closed its side
                    time.sleep(0.1)
        return m

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


def test_cli_start_on_a_terminal_is_an_interactive_pty_shell(server: ServerProcess) -> None:
    before = sandbox_ids(server)
    term = Terminal(server, "start")
    try:
        sid = term.expect(r"sandbox (\w+) is running", timeout=300).group(1).decode()
        prompt = term.expect(PROMPT).end()
        assert termios.tcgetattr(term.slave)[3] & termios.ICANON == 0, "the local terminal should be raw"
        term.type("echo $((6*7))\r")
        term.expect(r"[\r\n]42\r\n", since=prompt)
        # The shell runs on a PTY of the local terminal's size, and follows it when it changes.
        term.type("stty size\r")
        term.expect(r"[\r\n]30 100\r\n", since=prompt)
        term.resize(111, 33)
        os.kill(term.proc.pid, signal.SIGWINCH)
        seen = len(term.out)
        deadline = time.monotonic() + 60
        while not re.search(rb"[\r\n]33 111\r\n", term.out[seen:]):
            assert time.monotonic() < deadline, term.out[-1000:]
            term.type("stty size\r")
            term.expect(r"[\r\n]\d+ \d+\r\n", since=len(term.out))
        # Ctrl-C reaches the remote foreground process (raw mode: the byte 0x03), not aenv.
        term.type("sleep 100\r")
        time.sleep(3)
        mark, t0 = len(term.out), time.monotonic()
        term.type("\x03")
        term.type("echo after-$?\r")
        term.expect(r"after-130", since=mark, timeout=30)
        assert time.monotonic() - t0 < 30 and term.proc.poll() is None
        term.type("exit 7\r")
        assert term.proc.wait(timeout=60) == 7
        term.expect(f"sandbox {sid} killed")
        assert termios.tcgetattr(term.slave) == term.cooked, "the terminal settings must be restored"
    finally:
        term.close()
    assert sandbox_ids(server) == before


def test_cli_connect_resumes_a_paused_sandbox(server: ServerProcess, api: httpx.Client, sandbox: str) -> None:
    run(api, sandbox, "echo kept > /home/user/marker")
    assert api.post(f"/sandboxes/{sandbox}/pause").status_code == 204
    assert api.get(f"/sandboxes/{sandbox}").json()["state"] == "paused"
    r = aenv(server, "connect", sandbox, stdin="cat /home/user/marker; exit 4\n")
    assert r.returncode == 4, r.stderr
    assert r.stdout == "kept\n"
    assert api.get(f"/sandboxes/{sandbox}").json()["state"] == "running"  # left running
    term = Terminal(server, "connect", sandbox)
    try:
        term.expect(f"connected to sandbox {sandbox}", timeout=120)
        prompt = term.expect(PROMPT).end()
        term.type("cat /home/user/marker\r")
        kept = term.expect(r"[\r\n]kept\r\n", since=prompt).end()
        # Ctrl-D at the next prompt: the shell ends with the last status. Typed before that
        # prompt, it would reach the PTY while its line discipline is still canonical (as for
        # any terminal), where it is an end-of-file for `cat`, not a key for bash's readline.
        term.expect(PROMPT, since=kept)
        term.type("\x04")
        assert term.proc.wait(timeout=60) == 0
    finally:
        term.close()
    assert api.get(f"/sandboxes/{sandbox}").json()["state"] == "running"
    # The window closes (SIGHUP) while a command runs in the shell: the shell and its
    # foreground command end in the sandbox too (they ran on, one shell left per window).
    term = Terminal(server, "connect", sandbox)
    try:
        prompt = term.expect(PROMPT, timeout=120).end()
        term.type("sleep 77\r")
        term.expect("sleep 77", since=prompt)
        time.sleep(2)
        term.proc.send_signal(signal.SIGHUP)
        assert term.proc.wait(timeout=60) == 128 + signal.SIGHUP
    finally:
        term.close()
    left = run(api, sandbox, "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
                             " | grep -c '^sleep 77 ' || true")["stdout"]
    assert left.strip() == "0", "the shell's command ran on after its window closed"


def test_cli_doctor_against_a_live_server(server: ServerProcess) -> None:
    r = aenv(server, "doctor")
    assert "tcg" in r.stdout or "kvm" in r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    r = aenv(server, "template", "ls", "-o", "table")
    base = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["base"])
    assert "built-in" in base, r.stdout


def test_cli_exec_passes_bytes_exactly_keeps_the_commands_options_and_ctrl_c_ends_it(
        server: ServerProcess, api: httpx.Client, sandbox: str, tmp_path: Path) -> None:
    """Output that is not UTF-8 (a binary file) or a character split across two writes comes
    out byte for byte (each chunk was decoded alone, with U+FFFD for what did not decode); the
    command's own -e stays its own; a command that cannot start exits as in a shell; Ctrl-C
    on aenv exec ends the command in the sandbox too (it ran on)."""
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
    sid = sandbox
    blob = os.urandom(200_000)
    src = tmp_path / "blob.bin"
    src.write_bytes(blob)
    assert aenv(server, "upload", sid, str(src), "/tmp/blob.bin").returncode == 0
    r = subprocess.run([*AENV, "exec", sid, "cat", "/tmp/blob.bin"], capture_output=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout == blob
    r = subprocess.run([*AENV, "exec", sid, "--", "sh", "-c", r"printf '\303'; sleep 0.3; printf '\251\n'"],
                       capture_output=True, env=env, timeout=120)
    assert r.stdout == "é\n".encode()
    r = subprocess.run([*AENV, "exec", sid, "grep", "-e", "root", "/etc/passwd"], capture_output=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(b"root:")
    # A program that is not there (127) or may not be run (126) fails to start, as in a shell;
    # over plain HTTP that is a 400 naming it.
    r = subprocess.run([*AENV, "exec", sid, "/nonexistent/tool", "x"], capture_output=True, env=env, timeout=120)
    assert r.returncode == 127 and b"No such file or directory" in r.stderr, r
    run(api, sid, "echo 'echo ran' > /tmp/plain; chmod 644 /tmp/plain")
    r = subprocess.run([*AENV, "exec", sid, "/tmp/plain", "x"], capture_output=True, env=env, timeout=120)
    assert r.returncode == 126 and b"Permission denied" in r.stderr, r
    answer = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["/nonexistent/tool"]})
    assert answer.status_code == 400 and "/nonexistent/tool" in answer.json()["message"], answer.text
    p = subprocess.Popen([*AENV, "exec", sid, "--", "sh", "-c", "sleep 4; touch /tmp/ctrl-c-marker"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(2.0)
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == 130
    time.sleep(4.0)
    assert run(api, sid, "test -e /tmp/ctrl-c-marker; echo $?")["stdout"] == "1\n", "the command ran on"


def test_cli_exec_with_stdin_feeds_the_command_and_ctrl_c_ends_it(
        server: ServerProcess, api: httpx.Client, sandbox: str) -> None:
    """`aenv exec -i` sends the local stdin to the command until EOF (binary, larger than one
    chunk); without -i the command's stdin is empty, so a reader does not wait for input."""
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
    sid = sandbox
    blob = os.urandom(300_000)
    r = subprocess.run([*AENV, "exec", "-i", sid, "--", "sh", "-c", "cat > /tmp/in.bin; echo got; exit 3"],
                       input=blob, capture_output=True, env=env, timeout=120)
    assert (r.returncode, r.stdout) == (3, b"got\n"), r.stderr
    digest = run(api, sid, "sha256sum < /tmp/in.bin")["stdout"].split()[0]
    assert digest == hashlib.sha256(blob).hexdigest()
    r = subprocess.run([*AENV, "exec", "-i", sid, "tr a-z A-Z"], input=b"shout\n", capture_output=True, env=env,
                       timeout=120)
    assert (r.returncode, r.stdout) == (0, b"SHOUT\n"), r.stderr
    r = subprocess.run([*AENV, "exec", sid, "--", "wc", "-c"], input=b"ignored", capture_output=True, env=env,
                       timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, b"0")
    # a command that stops reading early is not an error; a signal death is 128+N, as in a shell
    r = subprocess.run([*AENV, "exec", "-i", sid, "--", "head", "-c", "10"], input=blob * 16, capture_output=True,
                       env=env, timeout=120)
    assert (r.returncode, r.stdout) == (0, blob[:10]), r.stderr
    for flags in ([], ["-i"]):
        r = subprocess.run([*AENV, "exec", *flags, sid, "--", "sh", "-c", "kill -SEGV $$"], input=b"",
                           capture_output=True, env=env, timeout=120)
        assert r.returncode == 139 and b"segmentation fault" in r.stderr, (flags, r.returncode, r.stderr)
    # stdin left open (nothing written, no EOF): Ctrl-C ends aenv and the command in the sandbox
    p = subprocess.Popen([*AENV, "exec", "-i", sid, "--", "sh", "-c", "cat; touch /tmp/ctrl-c-i-marker"],
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(3.0)
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == 130, p.stderr.read()
    p.stdin.close()
    time.sleep(1.0)
    assert run(api, sid, "pgrep -x cat; test -e /tmp/ctrl-c-i-marker; echo $?")["stdout"] == "1\n", \
        "the command ran on after aenv went"
    paused = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    try:
        assert api.post(f"/sandboxes/{paused}/pause").status_code == 204
        r = subprocess.run([*AENV, "exec", "-i", paused, "--", "cat"], input=b"x", capture_output=True, env=env,
                           timeout=120)
        assert r.returncode == 125 and b"is paused" in r.stderr and b"aenv resume" in r.stderr, r.stderr
    finally:
        api.delete(f"/sandboxes/{paused}")
