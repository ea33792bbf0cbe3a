"""The guest agent under the clients thousands of rollouts bring: ones that vanish mid-call,
fall behind, send what the kernel cannot take, race each other. Each test failed on the agent
before its fix (a read-only review reproduced them against the real agent, as here)."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import os
import socket
import struct
import subprocess
import threading
import time
import urllib.parse

import httpx

from .conftest import RunningAgent
from .test_agent import envelope, parse_envelopes

CONNECT_JSON = {"Content-Type": "application/connect+json"}


def _port(agent: RunningAgent) -> int:
    return int(urllib.parse.urlsplit(agent.url).port or 0)


def _unary(agent: RunningAgent, name: str, msg: object) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=60)
    try:
        c.request("POST", "/" + name, json.dumps(msg).encode(), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def _start(agent: RunningAgent, cmd: str, *args: str, **extra: object) -> tuple[int, list[tuple[int, dict]]]:
    c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=120)
    try:
        body = envelope({"process": {"cmd": cmd, "args": list(args)}, **extra})
        c.request("POST", "/process.Process/Start", body, CONNECT_JSON)
        r = c.getresponse()
        return r.status, parse_envelopes(r.read())
    finally:
        c.close()


def _listed(agent: RunningAgent) -> list[str]:
    status, out = _unary(agent, "process.Process/List", {})
    assert status == 200
    return [p.get("tag", "") for p in out.get("processes", [])]


def test_a_client_reset_right_after_start_does_not_leave_its_command_stuck(agent: RunningAgent) -> None:
    """The command writes more than a pipe holds; its client resets the connection around the
    time the start event is written (many arguments widen that window: the spawn builds them
    first). Every command must still run to its end and leave the list."""
    port = _port(agent)
    for i, delay in enumerate((0.0, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15)):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        s.connect(("127.0.0.1", port))
        body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "seq 1 3000000", "sh", *["x"] * 30000]},
                         "stdin": False, "tag": f"rst{i}"})
        s.sendall(b"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(delay)
        s.close()
    deadline = time.monotonic() + 60
    while any(t.startswith("rst") for t in _listed(agent)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(t.startswith("rst") for t in _listed(agent)), "a command stayed blocked on its output"


def test_a_start_the_kernel_cannot_take_is_invalid_and_leaks_nothing(agent: RunningAgent) -> None:
    def fds() -> int:
        return len(os.listdir(f"/proc/{agent.pid}/fd"))

    before = fds()
    for _ in range(40):
        status, frames = _start(agent, "/bin/echo", "\ud800")  # a lone surrogate: no file name, no argv
        assert status == 200
        assert frames[-1][1]["error"]["code"] == "invalid_argument", frames
    assert fds() <= before + 2  # each failed Start kept 6 descriptors before
    status, frames = _start(agent, "/bin/echo", "still fine")
    data = b"".join(base64.b64decode(f[1]["event"]["data"]["stdout"]) for f in frames
                    if "event" in f[1] and "data" in f[1]["event"])
    assert data == b"still fine\n"


def test_output_written_before_exit_reaches_a_client_that_fell_behind(agent: RunningAgent) -> None:
    """The client stops reading right after the start event, for longer than the agent's exit
    grace, then reads everything: every byte the command wrote before it exited must arrive
    before the end (the tail was dropped, and the end still said success)."""
    nbytes = 5_400_000  # more than the agent's queue and the socket buffers hold, less than with the pipe
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.settimeout(60)
    s.connect(("127.0.0.1", _port(agent)))
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", f"head -c {nbytes} /dev/zero; printf TAIL"]},
                     "stdin": False})
    s.sendall(b"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    raw = bytearray(s.recv(200))
    time.sleep(3.0)  # the command has long exited
    while not (raw.endswith(b"0\r\n\r\n") and b'"end"' in raw[-4096:]):
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        raw += chunk
    s.close()
    _, _, rest = bytes(raw).partition(b"\r\n\r\n")
    data, i = bytearray(), 0
    while True:  # de-chunk
        j = rest.index(b"\r\n", i)
        n = int(rest[i:j], 16)
        if n == 0:
            break
        data += rest[j + 2:j + 2 + n]
        i = j + 2 + n + 2
    frames = parse_envelopes(bytes(data))
    out = b"".join(base64.b64decode(f[1]["event"]["data"]["stdout"]) for f in frames
                   if "event" in f[1] and "data" in f[1]["event"])
    assert (len(out), out[-4:]) == (nbytes + 4, b"TAIL")
    assert any("end" in f[1].get("event", {}) for f in frames)


def test_send_input_to_a_process_that_does_not_read_waits_instead_of_buffering(agent: RunningAgent) -> None:
    """Input piled up in the agent's memory for a process that never reads it (the guest's
    agent is then OOM-killed with every process's state); now the caller waits."""
    started = threading.Thread(target=_start, args=(agent, "/bin/sh", "-c", "exec sleep 60"),
                               kwargs={"tag": "noread", "stdin": True}, daemon=True)
    started.start()
    deadline = time.monotonic() + 10
    while "noread" not in _listed(agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    answers: list[int] = []
    payload = base64.b64encode(b"x" * (1 << 20)).decode()
    sender = threading.Thread(target=lambda: answers.append(_unary(
        agent, "process.Process/SendInput", {"process": {"tag": "noread"}, "input": {"stdin": payload}})[0]),
        daemon=True)
    sender.start()
    sender.join(2.0)
    assert sender.is_alive() and answers == [], "1 MiB for a process that reads nothing was taken at once"
    assert _unary(agent, "process.Process/SendSignal", {"process": {"tag": "noread"}, "signal": "SIGNAL_SIGKILL"})[0] == 200
    sender.join(15)
    assert answers == [200]  # the process ended: its stdin closed, the call answers
    started.join(15)


def test_a_negative_content_length_or_chunk_size_is_refused(agent: RunningAgent) -> None:
    port = _port(agent)
    for head in (b"Content-Length: -1\r\n", b"Transfer-Encoding: chunked\r\n"):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        body = b"-1\r\n" if b"chunked" in head else b""
        s.sendall(b"POST /files?path=/tmp/x HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + body)
        answer = s.recv(4096)
        s.close()
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]


def test_two_first_inputs_at_once_both_reach_the_process(agent: RunningAgent) -> None:
    """Two SendInput calls that arrive together as a process's first input (the last byte of
    each request sent at the same moment): both are taken (one was refused, "stdin of the
    process is not open", while the other made the pipe's transport)."""
    port = _port(agent)
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = envelope({"process": {"cmd": "/bin/cat"}, "stdin": True})
        s.sendall(b"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        pid = int(s.recv(4096).split(b'"pid":')[1].split(b"}")[0])
        msg = json.dumps({"process": {"pid": pid}, "input": {"stdin": base64.b64encode(b"x\n").decode()}}).encode()
        req = (b"POST /process.Process/SendInput HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(msg) + msg)
        c1 = socket.create_connection(("127.0.0.1", port), timeout=30)
        c2 = socket.create_connection(("127.0.0.1", port), timeout=30)
        c1.sendall(req[:-1])
        c2.sendall(req[:-1])
        c1.sendall(req[-1:])
        c2.sendall(req[-1:])
        answers = [c.recv(4096).split(b"\r\n")[0] for c in (c1, c2)]
        _unary(agent, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
        for c in (s, c1, c2):
            c.close()
        assert answers == [b"HTTP/1.1 200 OK"] * 2, answers


def test_unary_failures_are_connect_errors(agent: RunningAgent, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    cases = [
        ("filesystem.Filesystem/ListDir", {"path": str(tmp_path), "depth": "x"}, "invalid_argument"),
        ("filesystem.Filesystem/MakeDir", {"path": str(tmp_path / "file" / "sub")}, None),
        ("filesystem.Filesystem/Stat", {"path": "\ud800"}, None),
    ]
    for name, msg, code in cases:
        status, out = _unary(agent, name, msg)
        assert isinstance(out.get("code"), str) and out["code"] != "internal", (name, status, out)
        if code:
            assert out["code"] == code


def test_a_failed_upload_leaves_another_uploads_file_alone(agent: RunningAgent, tmp_path) -> None:
    """Upload A creates a new file and stalls; upload B of the same path completes (it replaces
    A's file); then A's client goes away. A used to delete the path, i.e. B's file."""
    target = tmp_path / "shared.txt"
    port = _port(agent)
    a = socket.create_connection(("127.0.0.1", port), timeout=30)
    a.sendall(b"POST /files?path=" + urllib.parse.quote(str(target)).encode() + b" HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
    deadline = time.monotonic() + 10
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert target.exists()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/files?path=" + urllib.parse.quote(str(target)), b"from B",
              {"Content-Type": "application/octet-stream"})
    assert c.getresponse().status == 200
    c.close()
    a.close()  # A's upload fails now
    time.sleep(1.0)
    assert target.read_bytes() == b"from B"


def test_client_connections_are_probed_with_tcp_keepalive(agent: RunningAgent) -> None:
    """A peer that vanishes without a reset is found out by TCP keepalive (the kernel's timer
    on the agent's side of the connection), not after the default of over two hours."""
    import subprocess

    port = _port(agent)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 204")
    out = subprocess.run(["ss", "-tnoH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    s.close()
    assert "keepalive" in out, out


def test_the_end_is_not_held_off_forever_by_a_grandchild_that_keeps_writing(agent: RunningAgent) -> None:
    """The command exits while a background child keeps its stdout full, and the client reads
    slowly (so reading is mostly paused): the end still comes, within the drain bound."""
    import subprocess

    marker = "aenv-noisy-grandchild"
    writer = "import sys\nwhile True: sys.stdout.write('y' * 65536)"
    script = f"python3 -c \"{writer}\" {marker} & sleep 0.1; exit 0"
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.settimeout(60)
    s.connect(("127.0.0.1", _port(agent)))
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": False})
    s.sendall(b"POST /process.Process/Start HTTP/1.1\r\nHost: x\r\nContent-Type: application/connect+json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    t0 = time.monotonic()
    tail = b""
    try:
        while time.monotonic() - t0 < 40:
            chunk = s.recv(64 * 1024)
            if not chunk:
                break
            tail = (tail + chunk)[-8192:]
            if b'"end"' in tail:
                break
            time.sleep(0.01)  # about 6 MB/s: slower than the writer
        elapsed = time.monotonic() - t0
    finally:
        s.close()
        subprocess.run(["pkill", "-f", marker], check=False)
    assert b'"end"' in tail and elapsed < 25, elapsed


def test_a_request_head_that_never_completes_is_answered_408_and_closed(agent: RunningAgent) -> None:
    """A client that starts a request and stops (or trickles it) held the connection for the
    640 s keep-alive timeout; now the head has HEAD_TIMEOUT (3 s in these tests, 60 s in a
    sandbox) from its first byte. A connection that sends nothing stays open for keep-alive."""
    port = _port(agent)
    idle = socket.create_connection(("127.0.0.1", port), timeout=30)
    partial = socket.create_connection(("127.0.0.1", port), timeout=30)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
    t0 = time.monotonic()
    answer = b""
    while chunk := partial.recv(4096):
        answer += chunk
    waited = time.monotonic() - t0
    partial.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 2.5 < waited < 20, waited
    # The idle connection outlived the head timeout and still serves a request.
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle.recv(4096).startswith(b"HTTP/1.1 204")
    idle.close()


def test_a_big_tree_moved_into_a_recursive_watch_does_not_stall_other_requests(agent: RunningAgent, tmp_path) -> None:
    """A recursive watch adds a watch for every directory moved in and reports what it holds.
    Walking 40,000 entries ran on the event loop, and every other request (a health check, a
    command's output) waited for it; now the walk runs in a thread and requests are served
    meanwhile. The events still arrive complete and in order: a file written after the move
    is reported after its CREATE."""
    outside = tmp_path / "outside"
    for d in range(200):
        sub = outside / f"d{d:03}"
        sub.mkdir(parents=True)
        for f in range(200):
            (sub / f"f{f:03}").touch()
    root = tmp_path / "watched"
    root.mkdir()
    status, out = _unary(agent, "filesystem.Filesystem/CreateWatcher",
                         {"path": str(root), "recursive": True, "includeEntry": True})
    assert status == 200, out
    watcher = out["watcherId"]

    latencies: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=120)
        while not stop.is_set():
            t = time.monotonic()
            c.request("GET", "/health")
            assert c.getresponse().read() == b""
            latencies.append(time.monotonic() - t)
            time.sleep(0.01)
        c.close()

    pinger = threading.Thread(target=ping, daemon=True)
    pinger.start()
    time.sleep(0.3)
    before = len(latencies)
    t0 = time.monotonic()
    os.rename(outside, root / "tree")
    (root / "late.txt").write_bytes(b"x")
    events: list[dict] = []
    while not any(e["name"] == "late.txt" and e["type"] == "EVENT_TYPE_WRITE" for e in events[-5:]) \
            and time.monotonic() - t0 < 300:
        status, out = _unary(agent, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher})
        assert status == 200, out
        events += out.get("events", [])
    walk = time.monotonic() - t0
    stop.set()
    pinger.join(30)
    during = latencies[before:]
    created = {e["name"] for e in events if e["type"] == "EVENT_TYPE_CREATE"}
    assert "tree" in created and "tree/d199/f199" in created and "tree/d000/f000" in created
    assert len(created) == 1 + 200 + 200 * 200 + 1, len(created)
    assert all(e.get("entry", {}).get("path") for e in events if e["type"] == "EVENT_TYPE_CREATE")
    names = [e["name"] for e in events]
    assert names.index("tree") < names.index("tree/d000") < names.index("tree/d000/f000")
    # Health checks went on while the walk ran: none waited for the whole of it.
    print(f"walk {walk:.2f} s, {len(during)} health checks meanwhile, slowest {max(during):.3f} s")
    assert len(during) >= 3 and max(during) < walk / 3, (max(during), walk, len(during))
    assert _unary(agent, "filesystem.Filesystem/RemoveWatcher", {"watcherId": watcher})[0] == 200


def test_polling_watchers_nobody_polls_share_one_bounded_buffer(agent: RunningAgent, tmp_path) -> None:
    """Each polling watcher kept up to 65,536 events until polled, so watchers a client forgot
    to remove grew the agent's memory without bound (the agent is OOM-killed with every
    process's state). Now all of them share one budget of 65,536 events; the fullest buffer
    loses its oldest events, so each keeps the newest."""
    root = tmp_path / "busy"
    root.mkdir()
    watchers = []
    for _ in range(5):
        status, out = _unary(agent, "filesystem.Filesystem/CreateWatcher", {"path": str(root)})
        assert status == 200, out
        watchers.append(out["watcherId"])
    for i in range(15_000):  # below the kernel's queue of 16,384 per watcher: none lost there
        (root / f"f{i:05}").touch()
    time.sleep(1.0)
    kept = []
    for watcher in watchers:
        status, out = _unary(agent, "filesystem.Filesystem/GetWatcherEvents", {"watcherId": watcher})
        assert status == 200
        kept.append(out.get("events", []))
        assert kept[-1] and kept[-1][-1]["name"] == "f14999", "the newest event is kept"
    total = sum(len(events) for events in kept)
    assert 60_000 <= total <= 65_536, [len(events) for events in kept]
    for watcher in watchers:
        assert _unary(agent, "filesystem.Filesystem/RemoveWatcher", {"watcherId": watcher})[0] == 200


def test_a_watch_client_too_slow_for_its_events_costs_one_log_line(agent: RunningAgent, tmp_path) -> None:
    """A WatchDir client that stops reading: its events past the agent's buffer are dropped,
    and that is logged once per stream, not once per dropped event (a busy directory wrote a
    line per file change to the agent's log and the console the host keeps)."""
    root = tmp_path / "busy"
    root.mkdir()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", _port(agent)))
    body = envelope({"path": str(root)})
    sock.sendall(b"POST /filesystem.Filesystem/WatchDir HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/connect+json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.5)  # the watch is set up; from now on nothing is read
    try:
        for batch in range(40):  # 160,000 events, in batches the agent keeps up with (no kernel overflow)
            for i in range(2000):
                p = root / f"f{batch}-{i}"
                p.touch()
                p.unlink()
            time.sleep(0.15)
        time.sleep(1.0)
        lines = [line for line in agent.log.read_text().splitlines() if "dropping events" in line]
        assert len(lines) == 1, f"{len(lines)} lines"
    finally:
        sock.close()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_deep_listings_neither_starve_the_agent_nor_outlive_their_clients(agent: RunningAgent) -> None:
    """ListDir walks in a thread. Six clients listing / at depth 100 took every thread of the
    agent's pool, so a Stat (any file operation) waited for a walk of the whole file system;
    and the walks went on after their clients had given up."""
    body = json.dumps({"path": "/", "depth": 100}).encode()
    clients = []
    for _ in range(6):
        c = socket.create_connection(("127.0.0.1", _port(agent)))
        c.sendall(b"POST /filesystem.Filesystem/ListDir HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        clients.append(c)
    time.sleep(0.5)
    t0 = time.monotonic()
    status, out = _unary(agent, "filesystem.Filesystem/Stat", {"path": "/etc"})
    assert status == 200 and out["entry"]["type"] == "FILE_TYPE_DIRECTORY", out
    assert time.monotonic() - t0 < 3, "a Stat waited for the walks"
    for c in clients:
        c.close()
    time.sleep(1.5)  # the walks see their clients gone within a poll
    cpu = _cpu_seconds(agent.pid)
    time.sleep(1.0)
    assert _cpu_seconds(agent.pid) - cpu < 0.3, "walks go on for clients that are gone"


def test_a_listing_of_the_whole_file_system_is_refused_not_held_in_memory(agent: RunningAgent) -> None:
    """/ at depth 100 (/proc, /sys, /usr...) is far more than one answer may hold: the agent
    would have to keep every entry, and a guest OOM kill takes the sandbox's processes."""
    status, out = _unary(agent, "filesystem.Filesystem/ListDir", {"path": "/", "depth": 100})
    assert status == 429 and out["code"] == "resource_exhausted", (status, str(out)[:300])
    assert "smaller depth" in out["message"]


FILL_THE_PIPE = r"""
import fcntl, os, select
fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) | os.O_NONBLOCK)
blocks = 0
while True:  # 4 KiB blocks (atomic on a pipe) until the pipe stays full: the agent stopped reading it
    try:
        os.write(1, b"%08d" % blocks * 512)
    except BlockingIOError:
        if not select.select([], [1], [], 2.0)[1]:
            break
        continue
    blocks += 1
os.write(2, b"blocks=%d" % blocks)
"""


def test_a_client_that_falls_behind_gets_all_output_and_the_ended_process_leaves_the_list(
        agent: RunningAgent) -> None:
    """A client that does not read (the sync SDK's background handle until wait()) makes the
    agent stop reading the command's pipe. The command exits with its last 64 KiB in that pipe;
    the end comes after EXIT_DRAIN_MAX (10 s) without the client. That output was dropped (the
    end said success), and the process stayed in List as running until its client read."""
    c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=120)
    c.request("POST", "/process.Process/Start",
              envelope({"process": {"cmd": "/usr/bin/python3", "args": ["-c", FILL_THE_PIPE]}}), CONNECT_JSON)
    try:
        time.sleep(14)  # the pipe stays full 2 s, the exit, EXIT_DRAIN_MAX: the end is out without the client
        status, listed = _unary(agent, "process.Process/List", {})
        assert status == 200
        assert not [p for p in listed.get("processes", []) if "FILL_THE_PIPE" in str(p) or "blocks" in str(p)], listed
        frames = parse_envelopes(c.getresponse().read())
    finally:
        c.close()
    out, err, end = b"", b"", None
    for _, m in frames:
        event = m.get("event") or {}
        out += base64.b64decode((event.get("data") or {}).get("stdout", ""))
        err += base64.b64decode((event.get("data") or {}).get("stderr", ""))
        end = event.get("end", end)
    blocks = int(err.decode().removeprefix("blocks="))
    assert end is not None and end.get("exited"), end
    assert blocks > 16 and len(out) == blocks * 4096, (blocks, len(out))
    assert out[-4096:] == b"%08d" % (blocks - 1) * 512, "the last block written"


def test_connect_timeout_zero_is_no_deadline_and_connect_by_tag_finds_the_latest(agent: RunningAgent) -> None:
    """Connect-Timeout-Ms: 0 is no deadline, as envd takes it (the agent killed the command at
    once); a Connect by tag to commands that ended finds the one that ended last (it found the
    first)."""
    c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=60)
    try:
        c.request("POST", "/process.Process/Start", envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 0.3; exit 4"]}}),
                  {**CONNECT_JSON, "Connect-Timeout-Ms": "0"})
        frames = parse_envelopes(c.getresponse().read())
    finally:
        c.close()
    assert frames[-2][1]["event"]["end"]["exitCode"] == 4, frames
    for code in (1, 2):
        status, frames = _start(agent, "/bin/sh", "-c", f"exit {code}", tag="job")
        assert status == 200
    c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=60)
    try:
        c.request("POST", "/process.Process/Connect", envelope({"process": {"tag": "job"}}), CONNECT_JSON)
        frames = parse_envelopes(c.getresponse().read())
    finally:
        c.close()
    ends = [m["event"]["end"] for _, m in frames if "end" in (m.get("event") or {})]
    assert [e.get("exitCode") for e in ends] == [2], frames


def test_a_gzip_upload_of_several_members_is_written_whole_and_trailing_garbage_refused(
        agent: RunningAgent, tmp_path) -> None:
    """``cat a.gz b.gz`` (and pigz) make one body of several gzip members; envd reads them all.
    The agent kept only the first and answered 200; bytes after a member that are no member
    were dropped silently too."""
    url = agent.url + "/files"
    body = gzip.compress(b"first-part\n") + gzip.compress(b"second-part\n" * 50000) + gzip.compress(b"end\n")
    r = httpx.post(url, params={"path": str(tmp_path / "m.txt")}, content=body,
                   headers={"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert (tmp_path / "m.txt").read_bytes() == b"first-part\n" + b"second-part\n" * 50000 + b"end\n"
    r = httpx.post(url, params={"path": str(tmp_path / "g.txt")}, content=gzip.compress(b"data\n") + b"garbage",
                   headers={"Content-Encoding": "gzip", "Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and not (tmp_path / "g.txt").exists()


def test_a_multipart_file_name_with_a_backslash_is_the_name_sent(agent: RunningAgent, tmp_path) -> None:
    """httpx (the Python SDK's write_files) quotes a backslash in a file name as two."""
    d = tmp_path / "up"
    d.mkdir()
    r = httpx.post(agent.url + "/files", files=[("file", (str(d / "a\\b.txt"), b"data"))])
    assert r.status_code == 200, r.text
    assert [p.name for p in d.iterdir()] == ["a\\b.txt"]
    assert r.json()[0]["path"] == str(d / "a\\b.txt")


def test_starts_the_kernel_would_refuse_are_invalid_and_cost_the_agent_little(agent: RunningAgent) -> None:
    """A Start of millions of args used to take gigabytes and stall the agent for seconds
    (each became a Python string first); a string for args ran its characters; a NUL cut an
    arg short; a PTY size outside 16 bits was ``internal``."""
    body = envelope({"process": {"cmd": "/bin/echo", "args": ["1"] * 400_000}})
    c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=60)
    t0 = time.monotonic()
    c.request("POST", "/process.Process/Start", body, CONNECT_JSON)
    frames = parse_envelopes(c.getresponse().read())
    c.close()
    assert frames[-1][1]["error"]["code"] == "invalid_argument" and time.monotonic() - t0 < 10
    assert int(open(f"/proc/{agent.pid}/status").read().split("VmHWM:")[1].split()[0]) < 400_000  # kB
    for extra in ({"process": {"cmd": "/bin/echo", "args": "abc"}},
                  {"process": {"cmd": "/bin/echo", "args": ["a\0b"]}},
                  {"process": {"cmd": "/bin/echo", "args": ["x"]}, "pty": {"size": {"cols": 70000, "rows": 24}}},
                  {"process": {"cmd": "/bin/echo", "args": ["x"]}, "pty": {"size": {"cols": -1, "rows": 24}}}):
        c = http.client.HTTPConnection("127.0.0.1", _port(agent), timeout=60)
        c.request("POST", "/process.Process/Start", envelope(extra), CONNECT_JSON)
        frames = parse_envelopes(c.getresponse().read())
        c.close()
        assert frames[-1][1]["error"]["code"] == "invalid_argument", (extra, frames)
    # Control messages are bounded at 4 MiB (input up to 16 MiB): a larger one is refused
    # before it is parsed.
    status, out = _unary(agent, "filesystem.Filesystem/Stat", {"path": "/", "pad": "x" * (5 << 20)})
    assert (status, out["code"]) == (429, "resource_exhausted"), out  # Connect maps the code to 429
    status, frames = _start(agent, "/bin/echo", "still fine")
    assert any("end" in f[1].get("event", {}) for f in frames)


def test_a_head_of_many_repeated_header_lines_is_refused(agent: RunningAgent) -> None:
    """Repeated names are joined into one value; without a bound on the lines that cost time
    quadratic in the head's size, before any token is checked."""
    s = socket.create_connection(("127.0.0.1", _port(agent)), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a: b\r\n" * 5000 + b"\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 431")
    s.close()
    assert httpx.get(agent.url + "/health").status_code == 204


def test_the_agent_goes_by_envds_name_not_pythons(agent: RunningAgent) -> None:
    """``pkill python`` / ``killall python3`` (an agent cleaning up its servers, as root) match
    a process by its name: the guest agent must not be one of theirs."""
    with open(f"/proc/{agent.pid}/comm") as f:
        assert f.read().strip() == "envd"
    matched = subprocess.run(["pgrep", "-x", "python3"], capture_output=True, text=True).stdout.split()
    assert str(agent.pid) not in matched
    r = httpx.get(agent.url + "/health", timeout=10)
    assert r.status_code in (200, 204)


def test_proc_and_sys_files_download_whole(agent: RunningAgent) -> None:
    """/proc files report a size of 0 and /sys files 4096: a download trusted that size, so
    /proc/version came back empty and a /sys file cut short of its Content-Length."""
    for path in ("/proc/version", "/sys/devices/system/cpu/online"):
        with open(path, "rb") as f:
            want = f.read()
        for encoding in ("identity", "gzip"):
            r = httpx.get(agent.url + "/files", params={"path": path, "username": "root"},
                          headers={"Accept-Encoding": encoding}, timeout=10)
            assert r.status_code == 200 and r.content == want, (path, encoding, r.status_code, r.content[:80])
