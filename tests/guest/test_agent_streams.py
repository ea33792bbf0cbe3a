"""The guest agent's streaming RPCs beyond Start/Connect: StreamInput (client stream), WatchDir
(server stream) and the polling watchers, plus keepalives on every long stream.

Everything goes over real HTTP to the agent subprocess (conftest.py), as an SDK would send it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest

from agentenv.envd_client import EnvdClient, EnvdError

from .test_agent import CONNECT_JSON, envelope, parse_envelopes

pytestmark = pytest.mark.timeout(120)


class EnvelopeStream:
    """Reads a Connect server stream in the background; ``next()`` / ``collect()`` take messages."""

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.queue: asyncio.Queue[tuple[int, dict] | None] = asyncio.Queue()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        buf = b""
        try:
            async for chunk in self.resp.aiter_raw():
                buf += chunk
                while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                    length = int.from_bytes(buf[1:5], "big")
                    self.queue.put_nowait(parse_envelopes(buf[:5 + length])[0])
                    buf = buf[5 + length:]
        finally:
            self.queue.put_nowait(None)

    async def next(self, timeout: float = 5.0) -> tuple[int, dict] | None:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def collect(self, quiet: float = 0.5) -> list[tuple[int, dict]]:
        """Every message until none arrives for ``quiet`` seconds (or the stream ends)."""
        out = []
        while True:
            try:
                item = await asyncio.wait_for(self.queue.get(), quiet)
            except TimeoutError:
                return out
            if item is None:
                return out
            out.append(item)


@contextlib.asynccontextmanager
async def open_stream(http: httpx.AsyncClient, method: str, message: dict,
                      headers: dict[str, str] | None = None) -> AsyncIterator[EnvelopeStream]:
    async with http.stream("POST", f"/{method}", content=envelope(message),
                           headers={**CONNECT_JSON, **(headers or {})}) as resp:
        assert resp.status_code == 200
        stream = EnvelopeStream(resp)
        try:
            yield stream
        finally:
            stream.task.cancel()


def fs_events(messages: list[tuple[int, dict]]) -> list[tuple[str, str]]:
    return [(m["filesystem"]["name"], m["filesystem"]["type"].removeprefix("EVENT_TYPE_"))
            for _, m in messages if "filesystem" in m]


def inotify_fds(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                count += 1
    return count


async def client_stream(http: httpx.AsyncClient, frames: list[bytes], method: str = "process.Process/StreamInput",
                        ) -> tuple[int, list[tuple[int, dict]]]:
    """POST a client stream as the SDK does: a chunked body, one envelope per chunk."""
    async def body() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame

    resp = await http.post(f"/{method}", content=body(), headers=CONNECT_JSON)
    return resp.status_code, parse_envelopes(resp.content) if resp.status_code == 200 else []


def stdin_frame(data: bytes, kind: str = "stdin") -> bytes:
    return envelope({"data": {"input": {kind: base64.b64encode(data).decode()}}})


# ---------------------------------------------------------------------------------------------
# process.Process/StreamInput
# ---------------------------------------------------------------------------------------------


async def test_stream_input_feeds_stdin_in_order(http: httpx.AsyncClient, client: EnvdClient) -> None:
    events = client.stream(["cat"], stdin=True)
    start = await events.__anext__()
    lines = [f"line {i}\n".encode() for i in range(300)]
    frames = [envelope({"start": {"process": {"pid": start.pid}}}), envelope({"keepalive": {}})]
    frames += [stdin_frame(line) for line in lines]
    status, reply = await client_stream(http, frames)
    assert status == 200
    assert reply == [(0, {}), (2, {})]
    await client.close_stdin(start.pid)
    rest = [e async for e in events]
    assert b"".join(e.data for e in rest if e.type == "stdout") == b"".join(lines)
    assert rest[-1].type == "end" and rest[-1].exit_code == 0


async def test_stream_input_by_tag_and_through_the_client(client: EnvdClient) -> None:
    events = client.stream(["sh", "-c", "head -c 3000000 | sha256sum"], stdin=True, tag="hasher")
    await events.__anext__()
    blob = os.urandom(3_000_000)  # more than any pipe buffer: StreamInput must wait for the reader

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(blob), 100_000):
            yield blob[i:i + 100_000]

    pid = next(p["pid"] for p in await client.list_processes() if p.get("tag") == "hasher")
    await client.stream_input(pid, chunks())
    rest = [e async for e in events]
    assert b"".join(e.data for e in rest if e.type == "stdout").split()[0].decode() == hashlib.sha256(blob).hexdigest()

    # By tag, on a PTY process: pty input reaches the terminal.
    body = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "read x; echo got:$x"]},
                     "pty": {"size": {"cols": 80, "rows": 24}}, "tag": "tty"})
    async with httpx.AsyncClient(base_url=client.base_url, timeout=30) as http:
        async with http.stream("POST", "/process.Process/Start", content=body, headers=CONNECT_JSON) as resp:
            stream = EnvelopeStream(resp)
            assert "start" in (await stream.next())[1]["event"]
            status, reply = await client_stream(http, [envelope({"start": {"process": {"tag": "tty"}}}),
                                                       stdin_frame(b"hello\r", "pty")])
            assert (status, reply) == (200, [(0, {}), (2, {})])
            output = b"".join(base64.b64decode(m["event"]["data"]["pty"]) for _, m in await stream.collect(1.0)
                              if "data" in m.get("event", {}))
            assert b"got:hello" in output


async def test_stream_input_errors(agent, client: EnvdClient) -> None:
    # One connection for everything: after each bad stream the agent still answers the next request.
    async with httpx.AsyncClient(base_url=agent.url, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
        status, reply = await client_stream(http, [envelope({"start": {"process": {"pid": 999999}}}),
                                                   stdin_frame(b"x")])
        assert status == 200 and reply[-1][0] == 2
        assert reply[-1][1]["error"]["code"] == "not_found"
        status, reply = await client_stream(http, [envelope({"start": {"process": {"tag": "no-such-tag"}}})])
        assert reply[-1][1]["error"]["code"] == "not_found"

        events = client.stream(["cat"], stdin=True)
        pid = (await events.__anext__()).pid
        bad_streams = [
            [stdin_frame(b"before start")],                                          # no start first
            [envelope({"start": {"process": {"pid": pid}}}), envelope({"start": {"process": {"pid": pid}}})],
            [envelope({"start": {"process": {"pid": pid}}}), envelope({"bogus": {}})],
            [envelope({"start": {"process": {"pid": pid}}}), envelope({"start": {}})[:-2]],  # truncated
            [envelope({"start": {"process": {"pid": pid}}}), b"\x00\x00\x00\x00\x03{x}"],    # bad JSON
            [envelope({"start": {"process": {"pid": pid}}}), b"\x01\x00\x00\x00\x02{}"],     # "compressed"
            [envelope({"start": {"process": {"pid": pid}}}), stdin_frame(b"x", "pty")],      # not a PTY
            [envelope({"start": {"process": {"pid": pid}}}),
             envelope({"data": {"input": {"stdin": "***"}}})],                               # bad base64
            [],                                                                              # empty stream
        ]
        for frames in bad_streams:
            status, reply = await client_stream(http, frames)
            assert status == 200, frames
            assert reply[-1][0] == 2 and reply[-1][1]["error"]["code"] == "invalid_argument", (frames, reply)
            assert (await http.get("/health")).status_code == 204
        status, reply = await client_stream(http, [envelope({"start": {"process": {"pid": pid}}}), stdin_frame(b"ok\n")])
        assert reply == [(0, {}), (2, {})]
        await client.close_stdin(pid)
        assert b"".join([e.data async for e in events if e.type == "stdout"]) == b"ok\n"

        # Input after the process ended: the stdin is gone.
        status, reply = await client_stream(http, [envelope({"start": {"process": {"pid": pid}}}), stdin_frame(b"late")])
        assert reply[-1][1]["error"]["code"] == "not_found"


# ---------------------------------------------------------------------------------------------
# filesystem.Filesystem/WatchDir
# ---------------------------------------------------------------------------------------------


async def test_watch_dir_reports_envd_events(agent, http: httpx.AsyncClient, client: EnvdClient, tmp_path: Path) -> None:
    root = tmp_path / "watched"
    root.mkdir()
    before = inotify_fds(agent.pid)
    async with open_stream(http, "filesystem.Filesystem/WatchDir", {"path": str(root)}) as stream:
        assert await stream.next() == (0, {"start": {}})
        assert inotify_fds(agent.pid) == before + 1

        await client.write_file(str(root / "a.txt"), b"first")
        assert fs_events(await stream.collect()) == [("a.txt", "CREATE"), ("a.txt", "CHMOD"), ("a.txt", "WRITE")]
        await client.write_file(str(root / "a.txt"), b"second, longer")  # overwrite: a WRITE, nothing else
        assert fs_events(await stream.collect()) == [("a.txt", "WRITE")]
        assert (root / "a.txt").read_bytes() == b"second, longer"

        os.chmod(root / "a.txt", 0o600)
        os.rename(root / "a.txt", root / "b.txt")
        (root / "b.txt").unlink()
        assert fs_events(await stream.collect()) == [("a.txt", "CHMOD"), ("a.txt", "RENAME"),
                                                     ("b.txt", "CREATE"), ("b.txt", "REMOVE")]
        # Not recursive: a subdirectory is reported, what happens inside it is not.
        (root / "sub").mkdir()
        (root / "sub" / "inner.txt").write_bytes(b"x")
        assert fs_events(await stream.collect()) == [("sub", "CREATE")]
    for _ in range(40):  # an idle stream notices a closed connection within a second or so
        if inotify_fds(agent.pid) == before:
            break
        await asyncio.sleep(0.1)
    assert inotify_fds(agent.pid) == before, "the inotify instance must be closed with the stream"


async def test_watch_dir_recursive_includes_new_subdirectories(http: httpx.AsyncClient, client: EnvdClient,
                                                              tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / "old").mkdir(parents=True)
    message = {"path": str(root), "recursive": True, "includeEntry": True}
    async with open_stream(http, "filesystem.Filesystem/WatchDir", message) as stream:
        assert (await stream.next())[1] == {"start": {}}
        (root / "old" / "f.txt").write_bytes(b"1")
        # Created after the watch started, faster than a watch can be added for each level.
        result = await client.run(["/bin/sh", "-c", f"mkdir -p {root}/n1/n2/n3 && echo hi > {root}/n1/n2/n3/deep.txt"])
        assert result.exit_code == 0
        messages = await stream.collect()
        events = fs_events(messages)
        assert ("old/f.txt", "CREATE") in events
        for name in ("n1", "n1/n2", "n1/n2/n3", "n1/n2/n3/deep.txt"):
            assert (name, "CREATE") in events, (name, events)
        created = [m["filesystem"] for _, m in messages if m["filesystem"]["name"] == "old/f.txt"]
        assert created[0]["entry"]["path"] == str(root / "old" / "f.txt")
        assert created[0]["entry"]["type"] == "FILE_TYPE_FILE"

        (root / "n1" / "n2" / "n3" / "deep.txt").write_bytes(b"again")  # the new level is watched
        assert ("n1/n2/n3/deep.txt", "WRITE") in fs_events(await stream.collect())
        shutil.rmtree(root / "n1")
        events = fs_events(await stream.collect())
        assert ("n1/n2/n3/deep.txt", "REMOVE") in events and ("n1", "REMOVE") in events


async def test_watch_dir_errors_keepalive_and_deadline(http: httpx.AsyncClient, tmp_path: Path) -> None:
    status, frames = await _watch_once(http, {"path": str(tmp_path / "missing")})
    assert frames[-1][1]["error"]["code"] == "not_found"
    (tmp_path / "file").write_bytes(b"")
    status, frames = await _watch_once(http, {"path": str(tmp_path / "file")})
    assert frames[-1][1]["error"]["code"] == "invalid_argument"

    # Idle streams get {"keepalive":{}} at the client's interval; the deadline ends the stream.
    start = time.monotonic()
    status, frames = await _watch_once(http, {"path": str(tmp_path)},
                                       {"Keepalive-Ping-Interval": "0.2", "Connect-Timeout-Ms": "1100"})
    assert status == 200
    assert frames[0] == (0, {"start": {}})
    assert 3 <= sum(1 for _, m in frames if m == {"keepalive": {}}) <= 6
    assert frames[-1][0] == 2 and frames[-1][1]["error"]["code"] == "deadline_exceeded"
    assert 1.0 < time.monotonic() - start < 3.0


async def _watch_once(http: httpx.AsyncClient, message: dict, headers: dict[str, str] | None = None):
    resp = await http.post("/filesystem.Filesystem/WatchDir", content=envelope(message),
                           headers={**CONNECT_JSON, **(headers or {})})
    return resp.status_code, parse_envelopes(resp.content)


async def test_watch_dir_through_the_client(client: EnvdClient, tmp_path: Path) -> None:
    seen: list[dict] = []

    async def watch() -> None:
        async for event in client.watch_dir(str(tmp_path), recursive=True, timeout=30):
            seen.append(event)

    task = asyncio.create_task(watch())
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.02)
    assert seen == [{"start": True}]
    await client.make_dir(str(tmp_path / "d"))
    await client.write_file(str(tmp_path / "d" / "x.txt"), b"x")
    await asyncio.sleep(0.5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    names = [(e["name"], e["type"]) for e in seen[1:]]
    assert names[0] == ("d", "EVENT_TYPE_CREATE")
    # (what happens in a new directory before its watch is placed is reported as a CREATE: see
    # test_polling_watcher_lifecycle)
    create, chmod, write = "EVENT_TYPE_CREATE", "EVENT_TYPE_CHMOD", "EVENT_TYPE_WRITE"
    assert [n[1] for n in names if n[0] == "d/x.txt"] in ([create, chmod, write], [create, write], [create]), names


# ---------------------------------------------------------------------------------------------
# Polling watchers (the sync SDK's watch_dir)
# ---------------------------------------------------------------------------------------------


async def test_polling_watcher_lifecycle(agent, client: EnvdClient, tmp_path: Path) -> None:
    before = inotify_fds(agent.pid)
    watcher_id = await client.create_watcher(str(tmp_path), recursive=True)
    assert inotify_fds(agent.pid) == before + 1
    assert await client.watcher_events(watcher_id) == []
    await client.write_file(str(tmp_path / "p" / "q.txt"), b"data")
    events = [(e["name"], e["type"]) for e in await client.watcher_events(watcher_id)]
    assert events[0] == ("p", "EVENT_TYPE_CREATE")
    # The upload creates the file, sets its owner and mode, then writes it. A new directory's
    # watch is placed when the agent sees the directory appear; what happened in it before
    # that is reported by a scan as a CREATE, so on a busy host the CHMOD, or the WRITE too,
    # may come before the watch and not be seen on their own.
    create, chmod, write = "EVENT_TYPE_CREATE", "EVENT_TYPE_CHMOD", "EVENT_TYPE_WRITE"
    assert [e[1] for e in events if e[0] == "p/q.txt"] in ([create, chmod, write], [create, write], [create]), events
    assert await client.watcher_events(watcher_id) == [], "events are drained by each call"
    (tmp_path / "p" / "q.txt").unlink()
    assert [(e["name"], e["type"]) for e in await client.watcher_events(watcher_id)] == [("p/q.txt", "EVENT_TYPE_REMOVE")]

    await client.remove_watcher(watcher_id)
    assert inotify_fds(agent.pid) == before
    for call in (client.watcher_events(watcher_id), client.remove_watcher(watcher_id),
                 client.watcher_events("no-such-watcher")):
        with pytest.raises(EnvdError) as err:
            await call
        assert err.value.code == "not_found"
    with pytest.raises(EnvdError) as err:
        await client.create_watcher(str(tmp_path / "missing"))
    assert err.value.code == "not_found"


# ---------------------------------------------------------------------------------------------
# Keepalives on process streams
# ---------------------------------------------------------------------------------------------


async def test_connect_stream_keepalives(http: httpx.AsyncClient, client: EnvdClient) -> None:
    events = client.stream(["sleep", "1.2"])
    pid = (await events.__anext__()).pid
    resp = await http.post("/process.Process/Connect", content=envelope({"process": {"pid": pid}}),
                           headers={**CONNECT_JSON, "Keepalive-Ping-Interval": "0.25"})
    frames = parse_envelopes(resp.content)
    assert frames[0][1] == {"event": {"start": {"pid": pid}}}
    assert sum(1 for _, m in frames if m == {"event": {"keepalive": {}}}) >= 3
    assert frames[-2][1]["event"]["end"]["exited"] is True and frames[-1] == (2, {})
    assert [e.type async for e in events] == ["end"]


async def test_a_new_directory_is_reported_once_per_entry(client: EnvdClient, tmp_path: Path) -> None:
    """An upload makes a directory and a file in it. The directory's walk adds a watch and
    scans it; a file made between those two steps was reported twice (by the scan and by the
    new watch). Now the watch's CREATE of an entry the scan reported is dropped."""
    watcher_id = await client.create_watcher(str(tmp_path), recursive=True)
    for i in range(40):
        await client.write_file(str(tmp_path / f"p{i}" / "q.txt"), b"data")
        events = [(e["name"], e["type"]) for e in await client.watcher_events(watcher_id)]
        assert events.count((f"p{i}", "EVENT_TYPE_CREATE")) == 1, (i, events)
        assert events.count((f"p{i}/q.txt", "EVENT_TYPE_CREATE")) == 1, (i, events)
    await client.remove_watcher(watcher_id)
