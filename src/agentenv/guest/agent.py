#!/usr/bin/env python3
"""AgentENV guest agent: a small, stdlib-only implementation of E2B's *envd*.

It runs as root inside every sandbox microVM (restarted by the guest's shell init if it dies) and
serves, on TCP port 49983, the part of the envd protocol AgentENV needs: Connect RPC with the JSON
codec over HTTP/1.1 for the ``process.Process`` and ``filesystem.Filesystem`` services, plus the
plain HTTP routes ``/health``, ``/init``, ``/envs`` and ``/files``.

Design notes (why it looks the way it does):

* The guest has nothing but Debian's ``python3``, so this is one file using only the stdlib. It
  shares no code with the host package and is copied into the image as is.
* One asyncio event loop serves everything. Blocking work (directory walks, disk I/O of big files)
  goes to the default thread pool, so one slow request never stalls another command's output.
* Children are spawned with ``subprocess.Popen`` (``user=``/``group=``/``extra_groups=`` switch
  users without a ``preexec_fn``) and reaped by a single SIGCHLD handler calling ``waitpid(-1)``.
  The agent is a child subreaper, so the same handler also reaps orphaned grandchildren (daemons
  started with ``&``) and zombies never pile up. asyncio's child watchers are deliberately unused:
  they would race with that handler for exit statuses.
* A process's output is fanned out to its subscribers (the Start stream, later Connect streams)
  through bounded queues: a slow client back-pressures the process instead of growing memory, and
  a client that goes away merely unsubscribes -- the process keeps running.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import datetime
import errno
import fcntl
import grp
import hashlib
import hmac
import json
import os
import pty
import pwd
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import termios
import time
import traceback
import urllib.parse
import zlib
from http import HTTPStatus
from typing import Any, AsyncIterator, Callable, NamedTuple

DEFAULT_PORT = 49983
# Where /init writes the E2B marker files. Tests point this at a temporary directory.
RUN_DIR = os.environ.get("AENV_AGENT_RUN_DIR", "/run/e2b")
# Test-only switch: with AENV_AGENT_NO_CLOCK=1, /init does not set the wall clock. Only the test
# suite sets it, because it runs the agent directly on the host, whose clock must not be touched.
NO_CLOCK = os.environ.get("AENV_AGENT_NO_CLOCK") == "1"
# What /init set, kept (root-only, on the guest's tmpfs) so that an agent restarted by the init
# after a crash still enforces the access token and applies the sandbox's env vars.
STATE_FILE = os.environ.get("AENV_AGENT_STATE", "/run/aenv-agent/state.json")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SETPRIV = shutil.which("setpriv", path=DEFAULT_PATH)  # util-linux; None in images without it
OUTPUT_CHUNK = 32 * 1024        # max payload of one process data event (envd uses 32 KiB)
FILE_CHUNK = 1024 * 1024        # unit of disk and socket I/O for /files
MAX_MESSAGE = 16 * 1024 * 1024  # max size of one RPC request message
IDLE_TIMEOUT = 640.0            # keep-alive idle timeout, longer than the proxies' 610/620 s
DEFAULT_KEEPALIVE = 90.0        # envd's default keepalive interval for streams
EXIT_GRACE = 1.0                # wait this long for pipes to close after the main process exits
FINISHED_TTL = 300.0            # finished processes stay visible to Process.Connect this long
RNDADDENTROPY = 0x40085203      # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207          # _IO('R', 0x07)
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM}
CONNECT_STATUS = {
    "canceled": 499, "unknown": 500, "internal": 500, "data_loss": 500, "invalid_argument": 400,
    "failed_precondition": 400, "out_of_range": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "aborted": 409, "permission_denied": 403, "resource_exhausted": 429,
    "unimplemented": 501, "unavailable": 503, "unauthenticated": 401,
}
CORS_HEADERS = {
    "Access-Control-Allow-Methods": "HEAD, GET, POST, PUT, PATCH, DELETE",
    "Access-Control-Allow-Headers": "*",
    "Access-Control-Expose-Headers": "Connect-Protocol-Version, Connect-Timeout-Ms, Grpc-Status, "
    "Grpc-Message, Location, Cache-Control, X-Content-Type-Options",
    "Access-Control-Max-Age": "7200",
}


def log(message: str) -> None:
    """Log to stderr, which the guest init forwards to the serial console."""
    print(f"{time.strftime('%H:%M:%S')} agent: {message}", file=sys.stderr, flush=True)


class ConnectError(Exception):
    """An RPC failure with a Connect error code such as ``not_found``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class HttpError(Exception):
    """A plain-HTTP failure, rendered as envd's ``{"code": <int>, "message": ...}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# --------------------------------------------------------------------------------------------
# HTTP/1.1
# --------------------------------------------------------------------------------------------


class Request:
    """One HTTP/1.1 request. The body is not read up front: handlers stream it with ``chunks()``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, method: str,
                 target: str, version: str, headers: dict[str, str]) -> None:
        self.reader, self.writer, self.method, self.headers = reader, writer, method, headers
        url = urllib.parse.urlsplit(target)
        self.path = urllib.parse.unquote(url.path)
        self.query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        conn = headers.get("connection", "").lower()
        self.keep_alive = (version == "HTTP/1.1" and "close" not in conn) or "keep-alive" in conn
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        try:
            self._remaining = 0 if self._chunked else int(headers.get("content-length") or 0)
        except ValueError:
            raise HttpError(400, "invalid Content-Length") from None
        self.body_done = not self._chunked and self._remaining == 0
        self._expect_continue = headers.get("expect", "").lower() == "100-continue"
        self._body: AsyncIterator[bytes] | None = None

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, never buffered. Every caller shares one iterator, so a handler
        that stops half-way can still ``drain()`` the rest and keep the connection in sync."""
        if self._body is None:
            self._body = self._read_body_chunks()
        return self._body

    async def _read_body_chunks(self) -> AsyncIterator[bytes]:
        """Read the body from the socket, decoding chunked transfer encoding."""
        if self.body_done:
            return
        if self._expect_continue:
            self._expect_continue = False
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self._chunked:
            while self._remaining:
                data = await self.reader.read(min(self._remaining, FILE_CHUNK))
                if not data:
                    raise ConnectionResetError("client closed the connection mid-body")
                self._remaining -= len(data)
                yield data
        else:
            while True:
                line = await self.reader.readline()
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HttpError(400, "malformed chunked body") from None
                if size == 0:
                    while (await self.reader.readline()).strip():  # skip trailers
                        pass
                    break
                while size:
                    data = await self.reader.read(min(size, FILE_CHUNK))
                    if not data:
                        raise ConnectionResetError("client closed the connection mid-body")
                    size -= len(data)
                    yield data
                await self.reader.readexactly(2)  # CRLF after each chunk
        self.body_done = True

    async def read_body(self, limit: int = MAX_MESSAGE) -> bytes:
        """Read the whole (small) body; larger ones are a client error."""
        body = bytearray()
        async for data in self.chunks():
            body += data
            if len(body) > limit:
                raise HttpError(413, "request body too large")
        return bytes(body)

    async def drain(self) -> None:
        """Discard any unread body so the connection can serve the next request."""
        async for _ in self.chunks():
            pass


class Response:
    """Writes one response, either whole (Content-Length) or streamed (chunked, flushed per write).

    The head is held back and sent together with the first body bytes, and the last chunk goes
    out with the terminator: each send() is a trip through the guest's TCP stack, which costs
    milliseconds when the guest is emulated, so a short stream takes two sends instead of five."""

    def __init__(self, writer: asyncio.StreamWriter, keep_alive: bool) -> None:
        self.writer, self.keep_alive = writer, keep_alive
        self.started = False
        self._chunked = False
        self._head = b""

    async def start(self, status: int, headers: dict[str, str], length: int | None = None) -> None:
        self.started = True
        all_headers = {"Access-Control-Allow-Origin": "*", **headers}
        if length is None:
            self._chunked = True
            all_headers["Transfer-Encoding"] = "chunked"
        elif status != 204:
            all_headers["Content-Length"] = str(length)
        if not self.keep_alive:
            all_headers["Connection"] = "close"
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:  # e.g. 499, Connect's "canceled"
            reason = "Unknown"
        head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in all_headers.items()) + "\r\n"
        self._head = head.encode("latin-1")

    def _take_head(self) -> bytes:
        head, self._head = self._head, b""
        return head

    async def write(self, data: bytes) -> None:
        """Send body bytes and wait until the socket accepted them (flush + back-pressure)."""
        if data and self._chunked:
            self.writer.writelines([self._take_head(), b"%x\r\n" % len(data), data, b"\r\n"])
        elif data or self._head:
            self.writer.writelines([self._take_head(), data])
        await self.writer.drain()

    async def finish(self, last: bytes = b"") -> None:
        """End the response; ``last`` (chunked only) is sent in the same write as the end."""
        parts = [self._take_head()]
        if self._chunked:
            if last:
                parts += [b"%x\r\n" % len(last), last, b"\r\n"]
            parts.append(b"0\r\n\r\n")
        self.writer.writelines(parts)
        await self.writer.drain()

    async def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        await self.start(status, headers or {}, len(body))
        await self.write(body)

    async def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json_bytes(obj), {"Content-Type": "application/json", **(headers or {})})


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
    """Parse the next request head; None on a clean close or after the idle timeout."""
    try:
        line = await asyncio.wait_for(reader.readline(), IDLE_TIMEOUT)
        while line in (b"\r\n", b"\n"):
            line = await reader.readline()
    except TimeoutError:
        return None
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed request line")
    headers: dict[str, str] = {}
    while (raw := await reader.readline()) not in (b"\r\n", b"\n"):
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or len(headers) > 200:
            raise HttpError(400, "malformed header")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return Request(reader, writer, parts[0].upper(), parts[1], parts[2], headers)


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json_object(data: bytes) -> dict:
    """Decode a JSON request message; anything but an object is an ``invalid_argument``."""
    try:
        obj = json.loads(data) if data.strip() else {}
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"invalid JSON message: {exc}") from None
    if not isinstance(obj, dict):
        raise ConnectError("invalid_argument", "message must be a JSON object")
    return obj


def envelope(flags: int, obj: Any) -> bytes:
    data = json_bytes(obj)
    return struct.pack(">BI", flags, len(data)) + data


def b64decode(value: Any) -> bytes:
    """Decode proto3 JSON ``bytes`` (standard or URL-safe alphabet, padding optional)."""
    try:
        text = str(value).replace("-", "+").replace("_", "/")
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except ValueError:
        raise ConnectError("invalid_argument", "invalid base64 data") from None


def field(msg: dict, camel: str, default: Any = None) -> Any:
    """Read a proto3 JSON field given in lowerCamelCase or in its original snake_case."""
    value = msg.get(camel)
    if value is None:
        value = msg.get(re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), camel))
    return default if value is None else value


# --------------------------------------------------------------------------------------------
# Users, paths and file metadata
# --------------------------------------------------------------------------------------------


class User(NamedTuple):
    name: str
    uid: int
    gid: int
    home: str
    groups: list[int]


def lookup_user(name: str) -> User | None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    try:
        groups = os.getgrouplist(name, pw.pw_gid)
    except OSError:
        groups = [pw.pw_gid]
    return User(name, pw.pw_uid, pw.pw_gid, pw.pw_dir, groups)


def chown_to(path_or_fd: str | int, user: User) -> None:
    """Give a file to the user; only possible (and needed) when the agent runs as root."""
    if os.geteuid() == 0:
        os.chown(path_or_fd, user.uid, user.gid, follow_symlinks=False) if isinstance(
            path_or_fd, str) else os.fchown(path_or_fd, user.uid, user.gid)


def make_dirs(path: str, user: User) -> None:
    """``mkdir -p`` where every directory created is 0755 and owned by the user."""
    missing, target = [], path
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            continue
        os.chmod(directory, 0o755)
        chown_to(directory, user)
    if not os.path.isdir(target):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", target)


def go_permissions(mode: int) -> str:
    """Render a mode like Go's ``os.FileMode.String()`` (``drwxr-xr-x``, ``Lrwxrwxrwx``, ``dtrwx...``)."""
    fmt = stat.S_IFMT(mode)
    flags = "".join(letter for letter, on in (
        ("d", fmt == stat.S_IFDIR), ("L", fmt == stat.S_IFLNK),
        ("D", fmt in (stat.S_IFBLK, stat.S_IFCHR)), ("p", fmt == stat.S_IFIFO),
        ("S", fmt == stat.S_IFSOCK), ("u", mode & stat.S_ISUID), ("g", mode & stat.S_ISGID),
        ("c", fmt == stat.S_IFCHR), ("t", mode & stat.S_ISVTX)) if on)
    rwx = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (flags or "-") + rwx


def rfc3339(ns: int) -> str:
    """Format a timestamp like protobuf's JSON mapping (0, 3, 6 or 9 fractional digits, UTC)."""
    sec, frac = divmod(ns, 10**9)
    text = (datetime.datetime(1970, 1, 1) + datetime.timedelta(seconds=sec)).strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        digits = f"{frac:09d}"
        text += "." + (digits[:3] if frac % 10**6 == 0 else digits[:6] if frac % 1000 == 0 else digits)
    return text + "Z"


def file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "FILE_TYPE_FILE"
    if stat.S_ISDIR(mode):
        return "FILE_TYPE_DIRECTORY"
    return "FILE_TYPE_SYMLINK" if stat.S_ISLNK(mode) else ""


def entry_info(path: str) -> dict:
    """EntryInfo as envd builds it: lstat for name/size/permissions; for a symlink the *target's*
    type and mode plus its resolved path. Default values are omitted, as proto3 JSON does."""
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path '{path}' does not exist") from None
    kind, mode, target = file_type(lst.st_mode), stat.S_IMODE(lst.st_mode) & 0o777, None
    if stat.S_ISLNK(lst.st_mode):
        try:
            target = os.path.realpath(path, strict=True)
        except OSError:  # broken or looping link: like Go's EvalSymlinks failing
            target = path
        try:
            st = os.stat(target)
            kind, mode = file_type(st.st_mode), stat.S_IMODE(st.st_mode) & 0o777
        except OSError:
            kind, mode = "", 0
    try:
        owner = pwd.getpwuid(lst.st_uid).pw_name
    except KeyError:
        owner = str(lst.st_uid)
    try:
        group = grp.getgrgid(lst.st_gid).gr_name
    except KeyError:
        group = str(lst.st_gid)
    entry = {"name": os.path.basename(path) or path, "type": kind, "path": path,
             "size": str(lst.st_size) if lst.st_size else "", "mode": mode,
             "permissions": go_permissions(lst.st_mode), "owner": owner, "group": group,
             "modifiedTime": rfc3339(lst.st_mtime_ns), "symlinkTarget": target}
    try:
        metadata = {name[len("user.e2b."):]: os.getxattr(path, name, follow_symlinks=False).decode(
            errors="replace") for name in os.listxattr(path, follow_symlinks=False)
            if name.startswith("user.e2b.")}
        entry["metadata"] = metadata
    except OSError:
        pass
    return {k: v for k, v in entry.items() if v not in (None, "", 0, {})}


async def blocking(fn: Callable, *args: Any) -> Any:
    """Run blocking filesystem work in the thread pool so the event loop stays responsive."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class Subscriber:
    """One consumer (a Start or Connect stream) of a process's events, with a bounded queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict] = asyncio.Queue(maxsize=64)
        self.closed = False

    async def put(self, event: dict) -> None:
        if not self.closed:
            await self.queue.put(event)

    def close(self) -> None:
        """Stop receiving; emptying the queue releases a producer blocked on a full queue."""
        self.closed = True
        while not self.queue.empty():
            self.queue.get_nowait()


class Process:
    """A command started through the agent: its pipes, its subscribers and, later, its end event."""

    def __init__(self, popen: subprocess.Popen, config: dict, tag: str | None,
                 pty_master: int | None) -> None:
        self.popen, self.pid, self.config, self.tag = popen, popen.pid, config, tag
        self.pty_master = pty_master
        self.stdin: asyncio.WriteTransport | None = None
        self.subscribers: set[Subscriber] = set()
        self.end: dict | None = None
        self.finished_at = 0.0
        self.deadline_exceeded = False
        self.exit_status: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task] = []  # strong references: the loop only keeps weak ones

    def info(self) -> dict:
        info = {"config": self.config, "pid": self.pid}
        if self.tag:
            info["tag"] = self.tag
        return info

    async def attach(self, timeout: float | None, on_finish: Callable[[Process], None]) -> None:
        """Connect the pipes to the event loop and start supervising the process."""
        loop = asyncio.get_running_loop()
        outputs = []
        if self.pty_master is not None:
            outputs.append((os.fdopen(self.pty_master, "rb", buffering=0), "pty"))
            writer = os.fdopen(os.dup(self.pty_master), "wb", buffering=0)
            self.stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, writer)
        else:
            outputs += [(self.popen.stdout, "stdout"), (self.popen.stderr, "stderr")]
            if self.popen.stdin is not None:
                self.stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, self.popen.stdin)
        readers = []
        for pipe, kind in outputs:
            reader = asyncio.StreamReader(limit=4 * OUTPUT_CHUNK)
            await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r), pipe)
            readers.append(asyncio.create_task(self._pump(reader, kind)))
        if timeout is not None:
            self._timer = loop.call_later(timeout, self._on_deadline)
        self._tasks = [*readers, asyncio.create_task(self._supervise(readers, on_finish))]

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        if self.end is not None:
            sub.queue.put_nowait({"end": self.end})
        else:
            self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        sub.close()

    def signal(self, signum: int) -> None:
        """Signal the whole process group (each command is its own session), so `bash -c 'a; b'`
        and anything it started in the foreground or background goes down with it."""
        try:
            os.killpg(self.pid, signum)
        except OSError:
            try:
                os.kill(self.pid, signum)
            except OSError:
                pass

    def on_exit(self, status: int) -> None:
        """Called by the SIGCHLD reaper; also stops Popen from ever waiting on the pid again."""
        self.popen.returncode = os.waitstatus_to_exitcode(status)
        if not self.exit_status.done():
            self.exit_status.set_result(status)

    def _on_deadline(self) -> None:
        log(f"process {self.pid} exceeded its timeout, killing it")
        self.deadline_exceeded = True
        self.signal(signal.SIGKILL)

    async def _broadcast(self, event: dict) -> None:
        for sub in list(self.subscribers):
            await sub.put(event)

    async def _pump(self, reader: asyncio.StreamReader, kind: str) -> None:
        """Forward one output pipe in <= 32 KiB chunks; keeps draining (to nobody) after the end
        so a lingering background grandchild never blocks on a full pipe or gets SIGPIPE."""
        try:
            while data := await reader.read(OUTPUT_CHUNK):
                if self.end is None:
                    await self._broadcast({"data": {kind: base64.b64encode(data).decode()}})
        except OSError:  # EIO on a PTY master once the last slave fd is closed
            pass

    async def _supervise(self, readers: list[asyncio.Task], on_finish: Callable) -> None:
        status = await self.exit_status
        if self._timer:
            self._timer.cancel()
        # The pipes normally close together with the process. A background grandchild may keep
        # them open forever; don't let that hold the end event back for more than EXIT_GRACE.
        if readers:
            await asyncio.wait(readers, timeout=EXIT_GRACE)
        if os.WIFSIGNALED(status):
            text = "signal: " + (signal.strsignal(os.WTERMSIG(status)) or str(os.WTERMSIG(status))).lower()
            end = {"exitCode": -1, "status": text, "error": text}
        else:
            code = os.WEXITSTATUS(status)
            end = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
            if code:
                end["error"] = end["status"]
            else:
                del end["exitCode"]
        await self._broadcast({"end": end})
        self.end, self.finished_at = end, time.monotonic()
        self.subscribers.clear()
        if self.stdin is not None:
            self.stdin.close()
        on_finish(self)


class ProcessManager:
    """The process registry behind the ``process.Process`` service."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.running: dict[int, Process] = {}
        self.finished: dict[int, Process] = {}

    def reap(self) -> None:
        """SIGCHLD handler: collect every exited child -- ours and orphans we inherited."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if (proc := self.running.get(pid)) is not None:
                proc.on_exit(status)

    def _finish(self, proc: Process) -> None:
        self.running.pop(proc.pid, None)
        self.finished[proc.pid] = proc
        cutoff = time.monotonic() - FINISHED_TTL
        for pid in [p.pid for p in self.finished.values() if p.finished_at < cutoff]:
            del self.finished[pid]

    def find(self, selector: Any, finished_ok: bool = False) -> Process:
        selector = selector if isinstance(selector, dict) else {}
        pid, tag = selector.get("pid"), selector.get("tag")
        candidates = list(self.running.values()) + (list(self.finished.values()) if finished_ok else [])
        for proc in candidates:
            if (pid is not None and str(proc.pid) == str(pid)) or (tag and proc.tag == tag):
                return proc
        raise ConnectError("not_found", f"process with {'pid ' + str(pid) if pid else 'tag ' + str(tag)} not found")

    async def spawn(self, msg: dict, ctx: CallContext) -> tuple[Process, Subscriber]:
        """Start a process; the returned subscriber is attached before any output is read."""
        cfg = msg.get("process") or {}
        cmd, args, envs = cfg.get("cmd"), [str(a) for a in cfg.get("args") or []], cfg.get("envs") or {}
        if not cmd or not isinstance(envs, dict):
            raise ConnectError("invalid_argument", "process.cmd is required")
        user = ctx.user()
        if cfg.get("cwd"):
            cwd = self.agent.resolve(cfg["cwd"], user)
            if not os.path.isdir(cwd):
                raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist")
        else:
            cwd = self.agent.default_workdir or user.home
            cwd = cwd if os.path.isdir(cwd) else "/"
        env = {"PATH": os.environ.get("PATH", DEFAULT_PATH), "HOME": user.home, "USER": user.name,
               "LOGNAME": user.name, **self.agent.env_vars, **{str(k): str(v) for k, v in envs.items()}}
        kwargs: dict[str, Any] = {"cwd": cwd, "env": env, "bufsize": 0, "close_fds": True}
        argv_prefix: list[str] = []
        if (user.uid, user.gid, set(user.groups)) == (os.geteuid(), os.getegid(), set(os.getgroups())):
            pass  # no switch needed; leaving user= unset also lets Popen use the much faster vfork
        elif os.geteuid() == 0 and SETPRIV:
            # setpriv switches user in the child's exec chain, so Popen can still vfork: a full
            # fork of this (Python) process is several times slower, most of all under TCG.
            if "/" not in cmd and shutil.which(cmd, path=env["PATH"]) is None:
                raise ConnectError("internal", f"error starting process '{cmd}': no such executable")
            groups = ",".join(str(g) for g in user.groups) or str(user.gid)
            argv_prefix = [SETPRIV, f"--reuid={user.uid}", f"--regid={user.gid}", f"--groups={groups}", "--"]
        elif os.geteuid() == 0:
            kwargs.update(user=user.uid, group=user.gid, extra_groups=user.groups)
        else:
            raise ConnectError("permission_denied", "the agent is not root and cannot switch users")
        argv, master, pty_cfg = [*argv_prefix, cmd, *args], None, msg.get("pty")
        try:
            if isinstance(pty_cfg, dict):
                master, slave = pty.openpty()
                size = pty_cfg.get("size") or {}
                set_winsize(master, size.get("cols", 80), size.get("rows", 24))
                chown_to(slave, user)
                # `setsid --ctty` makes the pty the controlling terminal without a preexec_fn.
                if (setsid := shutil.which("setsid")) is not None:
                    argv = [setsid, "--ctty", *argv]
                else:
                    kwargs["start_new_session"] = True
                try:
                    popen = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, **kwargs)
                finally:
                    os.close(slave)
            else:
                stdin = subprocess.PIPE if msg.get("stdin") is not False else subprocess.DEVNULL
                popen = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True, **kwargs)
        except OSError as exc:
            if master is not None:
                os.close(master)
            raise ConnectError("internal", f"error starting process '{cmd}': {exc}") from None
        config = {k: v for k, v in (("cmd", cmd), ("args", args), ("envs", envs),
                                      ("cwd", cfg.get("cwd"))) if v}
        proc = Process(popen, config, msg.get("tag") or None, master)
        self.running[proc.pid] = proc
        self.finished.pop(proc.pid, None)
        sub = proc.subscribe()
        await proc.attach(ctx.timeout, self._finish)
        return proc, sub

    async def follow(self, proc: Process, sub: Subscriber, ctx: CallContext,
                     deadline: float | None) -> AsyncIterator[dict]:
        """Relay a subscriber's events, adding keepalives when idle; stops after ``end``."""
        getter: asyncio.Future | None = None
        try:
            while True:
                if getter is None and not sub.queue.empty():
                    # Fast path: the event is already there; no future, no timer (each costs
                    # measurable time when the guest is emulated).
                    event = sub.queue.get_nowait()
                    yield {"event": event}
                    if "end" in event:
                        return
                    continue
                getter = getter or asyncio.ensure_future(sub.queue.get())
                wait = ctx.keepalive
                if deadline is not None:
                    if (left := deadline - time.monotonic()) <= 0:
                        raise ConnectError("deadline_exceeded", "stream deadline exceeded")
                    wait = min(wait, left)
                done, _ = await asyncio.wait({getter}, timeout=wait)
                if not done:
                    if deadline is None or time.monotonic() < deadline:
                        yield {"event": {"keepalive": {}}}
                    continue
                event, getter = getter.result(), None
                yield {"event": event}
                if "end" in event:
                    return
        finally:
            if getter is not None:
                getter.cancel()
            proc.unsubscribe(sub)

    async def rpc_start(self, msg: dict, ctx: CallContext) -> AsyncIterator[dict]:
        proc, sub = await self.spawn(msg, ctx)
        yield {"event": {"start": {"pid": proc.pid}}}
        async for event in self.follow(proc, sub, ctx, None):
            yield event
        if proc.deadline_exceeded:
            raise ConnectError("deadline_exceeded", "process killed: timeout (Connect-Timeout-Ms) elapsed")

    async def rpc_connect(self, msg: dict, ctx: CallContext) -> AsyncIterator[dict]:
        proc = self.find(msg.get("process"), finished_ok=True)
        sub = proc.subscribe()
        deadline = time.monotonic() + ctx.timeout if ctx.timeout is not None else None
        yield {"event": {"start": {"pid": proc.pid}}}
        async for event in self.follow(proc, sub, ctx, deadline):
            yield event

    async def rpc_list(self, msg: dict, ctx: CallContext) -> dict:
        return {"processes": [p.info() for p in self.running.values()]} if self.running else {}

    async def rpc_send_signal(self, msg: dict, ctx: CallContext) -> dict:
        proc = self.find(msg.get("process"))
        name = msg.get("signal")
        signum = SIGNALS.get(name) if isinstance(name, str) else (name if name in (9, 15) else None)
        if signum is None:
            raise ConnectError("invalid_argument", f"unsupported signal: {name!r}")
        proc.signal(signum)
        return {}

    async def rpc_send_input(self, msg: dict, ctx: CallContext) -> dict:
        proc = self.find(msg.get("process"))
        data = msg.get("input") or {}
        kind = "pty" if proc.pty_master is not None else "stdin"
        if kind not in data or len(data) != 1:
            raise ConnectError("invalid_argument", f"this process accepts only '{kind}' input")
        if proc.stdin is None or proc.stdin.is_closing():
            raise ConnectError("failed_precondition", "stdin of the process is not open")
        proc.stdin.write(b64decode(data[kind]))
        return {}

    async def rpc_close_stdin(self, msg: dict, ctx: CallContext) -> dict:
        proc = self.find(msg.get("process"))
        if proc.pty_master is not None:
            raise ConnectError("failed_precondition", "cannot close stdin of a PTY process")
        if proc.stdin is not None:
            proc.stdin.close()
        return {}

    async def rpc_update(self, msg: dict, ctx: CallContext) -> dict:
        proc = self.find(msg.get("process"))
        size = (msg.get("pty") or {}).get("size")
        if size:
            if proc.pty_master is None or proc.end is not None:
                raise ConnectError("failed_precondition", "the process has no PTY")
            set_winsize(proc.pty_master, size.get("cols", 80), size.get("rows", 24))
        return {}


def set_winsize(fd: int, cols: int, rows: int) -> None:
    """Resize a PTY; the kernel then sends SIGWINCH to its foreground process group."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))


# --------------------------------------------------------------------------------------------
# Filesystem service (blocking helpers run in the thread pool)
# --------------------------------------------------------------------------------------------


def list_dir(root: str, depth: int) -> list[dict]:
    """Entries below root up to ``depth`` levels, in Go's lexical pre-order walk order."""
    if not os.path.lexists(root):
        raise ConnectError("not_found", f"path '{root}' does not exist")
    if not os.path.isdir(root):
        raise ConnectError("invalid_argument", f"path '{root}' is not a directory")
    entries: list[dict] = []

    def walk(directory: str, level: int) -> None:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return
        for name in names:
            path = os.path.join(directory, name)
            try:
                entries.append(entry_info(path))
            except ConnectError:  # vanished meanwhile
                continue
            if level < depth and os.path.isdir(path) and not os.path.islink(path):
                walk(path, level + 1)

    walk(root, 1)
    return entries


def make_dir(path: str, user: User) -> dict:
    if os.path.isdir(path):
        raise ConnectError("already_exists", f"directory '{path}' already exists")
    if os.path.lexists(path):
        raise ConnectError("invalid_argument", f"path '{path}' already exists and is not a directory")
    make_dirs(path, user)
    return entry_info(path)


def move(source: str, destination: str, user: User) -> dict:
    if not os.path.lexists(source):
        raise ConnectError("not_found", f"path '{source}' does not exist")
    make_dirs(os.path.dirname(destination), user)
    shutil.move(source, destination)  # rename(2), or copy+delete across filesystems
    return entry_info(destination)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------
# /files helpers
# --------------------------------------------------------------------------------------------


class Multipart:
    """Streaming ``multipart/form-data`` parser: parts' bodies are yielded as they arrive."""

    def __init__(self, chunks: AsyncIterator[bytes], boundary: str) -> None:
        self._source = chunks.__aiter__()
        self._delimiter = b"\r\n--" + boundary.encode("latin-1")
        self._buf = bytearray(b"\r\n")  # so the first boundary looks like all later ones

    async def _fill(self) -> None:
        try:
            self._buf += await self._source.__anext__()
        except StopAsyncIteration:
            raise HttpError(400, "truncated multipart body") from None

    async def _until_delimiter(self) -> AsyncIterator[bytes]:
        keep = len(self._delimiter) - 1
        while (index := self._buf.find(self._delimiter)) < 0:
            if len(self._buf) > keep:
                yield bytes(self._buf[:-keep])
                del self._buf[:-keep]
            await self._fill()
        if index:
            yield bytes(self._buf[:index])
        del self._buf[:index + len(self._delimiter)]

    async def parts(self) -> AsyncIterator[tuple[dict[str, str], AsyncIterator[bytes]]]:
        """Yield ``(headers, body)``; an unconsumed body is skipped before the next part."""
        async for _ in self._until_delimiter():  # preamble
            pass
        while True:
            while len(self._buf) < 2:
                await self._fill()
            if self._buf.startswith(b"--"):
                return
            while (end := self._buf.find(b"\r\n\r\n")) < 0:
                if len(self._buf) > 64 * 1024:
                    raise HttpError(400, "multipart part headers too large")
                await self._fill()
            headers = {}
            for line in self._buf[:end].decode("utf-8", "replace").split("\r\n")[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            del self._buf[:end + 4]
            body = self._until_delimiter()
            yield headers, body
            async for _ in body:
                pass


def disposition_params(value: str) -> dict[str, str]:
    return {k.lower(): v[1:-1].replace('\\"', '"') if v.startswith('"') else v.strip()
            for k, v in re.findall(r';\s*([\w*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)', value)}


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def install_file(fd: int, tmp: str, path: str, user: User, umask: int) -> None:
    """Give the finished temp file its final mode/owner and atomically move it into place."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)  # overwriting keeps the mode, like O_TRUNC
    except OSError:
        mode = 0o666 & ~umask
    os.fchmod(fd, mode)
    chown_to(fd, user)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# The agent: state, routing, RPC dispatch
# --------------------------------------------------------------------------------------------


class CallContext:
    """Per-RPC data: headers, Connect deadline, keepalive interval and the requested user."""

    def __init__(self, agent: Agent, headers: dict[str, str]) -> None:
        self.agent, self.headers = agent, headers
        try:
            ms = headers.get("connect-timeout-ms")
            self.timeout = int(ms) / 1000.0 if ms else None
            self.keepalive = float(headers.get("keepalive-ping-interval") or DEFAULT_KEEPALIVE)
        except ValueError:
            raise ConnectError("invalid_argument", "invalid Connect-Timeout-Ms or Keepalive-Ping-Interval") from None
        self.keepalive = self.keepalive if self.keepalive > 0 else DEFAULT_KEEPALIVE

    def user(self) -> User:
        """The user from ``Authorization: Basic base64("<user>:")``, else the default user."""
        name = self.agent.default_user
        auth = self.headers.get("authorization", "")
        if auth[:6].lower() == "basic ":
            try:
                name = base64.b64decode(auth[6:].strip()).decode().partition(":")[0]
            except ValueError:
                raise ConnectError("unauthenticated", "invalid Authorization header") from None
        user = lookup_user(name)
        if user is None:
            raise ConnectError("unauthenticated", f"invalid username: '{name}'")
        return user


class Agent:
    """Sandbox-wide state (set by /init) and the request router."""

    def __init__(self) -> None:
        self.env_vars: dict[str, str] = {}
        self.access_token: str | None = None
        self.default_user = "user" if lookup_user("user") else "root"
        self.default_workdir: str | None = None
        self._markers: dict[str, str] = {}
        self._saved_state: dict | None = None
        self._load_state()
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.procs = ProcessManager(self)
        self.unary = {
            "process.Process/List": self.procs.rpc_list,
            "process.Process/SendSignal": self.procs.rpc_send_signal,
            "process.Process/SendInput": self.procs.rpc_send_input,
            "process.Process/CloseStdin": self.procs.rpc_close_stdin,
            "process.Process/Update": self.procs.rpc_update,
            "filesystem.Filesystem/Stat": self.rpc_stat,
            "filesystem.Filesystem/ListDir": self.rpc_list_dir,
            "filesystem.Filesystem/MakeDir": self.rpc_make_dir,
            "filesystem.Filesystem/Move": self.rpc_move,
            "filesystem.Filesystem/Remove": self.rpc_remove,
        }
        self.streams = {"process.Process/Start": self.procs.rpc_start,
                        "process.Process/Connect": self.procs.rpc_connect}

    def resolve(self, path: str, user: User) -> str:
        """``~`` is the user's home; relative paths start at the default workdir, else the home."""
        path = str(path or "")
        if path == "~" or path.startswith("~/"):
            path = user.home + path[1:]
        elif not path.startswith("/"):
            path = os.path.join(self.default_workdir or user.home, path)
        return os.path.normpath(path)

    # ---- routing ------------------------------------------------------------------------

    async def dispatch(self, req: Request, resp: Response) -> None:
        path, method = req.path, req.method
        if method == "OPTIONS":
            return await resp.send(204, headers=CORS_HEADERS)
        if path == "/health" and method in ("GET", "HEAD"):
            return await resp.send(204)
        if path == "/files" and method in ("GET", "POST"):
            user = self._files_auth(req, "read" if method == "GET" else "write")
            return await (self.download(req, resp, user) if method == "GET" else self.upload(req, resp, user))
        if path == "/init" and method == "POST":
            return await self.init(req, resp)
        if self.access_token is not None and not hmac.compare_digest(
                req.headers.get("x-access-token", "").encode(), self.access_token.encode()):
            raise HttpError(401, "unauthorized access, please provide a valid access token")
        if path == "/envs" and method == "GET":
            return await resp.send_json(200, self.env_vars, {"Cache-Control": "no-store"})
        if re.fullmatch(r"/[\w.]+\.\w+/\w+", path):
            if method != "POST":
                raise HttpError(405, "method not allowed")
            return await self.rpc(req, resp)
        raise HttpError(404, f"no route for {method} {path}")

    async def rpc(self, req: Request, resp: Response) -> None:
        """Connect protocol: unary calls answer JSON; server streams answer 5-byte envelopes
        (flags, big-endian length, JSON) and always finish with an end-stream envelope (0x02)."""
        name = req.path[1:]
        if name in self.streams:
            await resp.start(200, {"Content-Type": "application/connect+json"})
            end: dict = {}
            stream = None
            held = b""
            try:
                body = await req.read_body()
                if len(body) < 5 or len(body) != 5 + struct.unpack(">I", body[1:5])[0] or body[0] & 1:
                    raise ConnectError("invalid_argument", "malformed Connect envelope")
                msg = parse_json_object(body[5:])
                stream = self.streams[name](msg, CallContext(self, req.headers))
                async for out in stream:
                    if held:
                        await resp.write(held)
                    # A process's end event is the stream's last message: hold it to send it
                    # with the end-stream envelope in one write.
                    held = envelope(0, out) if "end" in (out.get("event") or {}) else b""
                    if not held:
                        await resp.write(envelope(0, out))
            except ConnectError as exc:
                end = {"error": {"code": exc.code, "message": exc.message}}
            except HttpError as exc:
                end = {"error": {"code": "invalid_argument", "message": exc.message}}
            except (ConnectionError, asyncio.IncompleteReadError):
                raise
            except Exception as exc:
                log(f"{name} failed: {traceback.format_exc()}")
                end = {"error": {"code": "internal", "message": str(exc)}}
            finally:
                if stream is not None:
                    await stream.aclose()
            return await resp.finish(held + envelope(2, end))
        try:
            body = await req.read_body()
            if name not in self.unary:
                raise ConnectError("unimplemented", f"{name} is not implemented")
            out = await self.unary[name](parse_json_object(body), CallContext(self, req.headers))
            await resp.send_json(200, out)
        except ConnectError as exc:
            await resp.send_json(CONNECT_STATUS.get(exc.code, 500), {"code": exc.code, "message": exc.message})

    # ---- /init --------------------------------------------------------------------------

    async def init(self, req: Request, resp: Response) -> None:
        """Called by the host after boot and after every snapshot restore (new id, clock, entropy)."""
        try:
            body = parse_json_object(await req.read_body())
        except ConnectError as exc:
            raise HttpError(400, exc.message) from None
        ts = body.get("timestamp")
        if ts is not None and not NO_CLOCK:
            try:
                if isinstance(ts, str):
                    ts = datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
                time.clock_settime(time.CLOCK_REALTIME, float(ts))
            except (OSError, ValueError) as exc:
                log(f"init: cannot set the clock: {exc}")
        if body.get("entropy"):
            try:
                entropy = base64.b64decode(body["entropy"])
            except ValueError:
                raise HttpError(400, "entropy must be base64") from None
            self._add_entropy(entropy)
        if isinstance(env := field(body, "envVars"), dict):
            self.env_vars.update({str(k): str(v) for k, v in env.items()})
        if "accessToken" in body or "access_token" in body:
            self.access_token = field(body, "accessToken") or None
        if field(body, "defaultUser"):
            self.default_user = field(body, "defaultUser")
        if field(body, "defaultWorkdir"):
            self.default_workdir = field(body, "defaultWorkdir")
        markers = {".E2B_SANDBOX": "true", ".E2B_SANDBOX_ID": field(body, "sandboxId"),
                   ".E2B_TEMPLATE_ID": field(body, "templateId")}
        self.env_vars["E2B_SANDBOX"] = "true"
        for env_name, value in (("E2B_SANDBOX_ID", markers[".E2B_SANDBOX_ID"]),
                                ("E2B_TEMPLATE_ID", markers[".E2B_TEMPLATE_ID"])):
            if value:
                self.env_vars[env_name] = str(value)
        try:
            for file_name, value in markers.items():
                # Only what changed: /init is on the create path, and every file operation
                # is slow under emulation.
                if value and self._markers.get(file_name) != str(value):
                    os.makedirs(RUN_DIR, exist_ok=True)
                    with open(os.path.join(RUN_DIR, file_name), "w") as f:
                        f.write(str(value))
                    self._markers[file_name] = str(value)
        except OSError as exc:
            log(f"init: cannot write {RUN_DIR}: {exc}")
        if body.get("hostname"):
            try:
                socket.sethostname(body["hostname"])
            except OSError as exc:
                log(f"init: cannot set hostname: {exc}")
        self._save_state()
        await resp.send(204)

    def _load_state(self) -> None:
        try:
            with open(STATE_FILE) as f:
                st = json.load(f)
        except (OSError, ValueError):
            return
        self.env_vars = dict(st.get("envVars") or {})
        self.access_token = st.get("accessToken")
        self.default_user = st.get("defaultUser") or self.default_user
        self.default_workdir = st.get("defaultWorkdir")
        log("restored the sandbox state set by the last /init")

    def _save_state(self) -> None:
        st = {"envVars": dict(self.env_vars), "accessToken": self.access_token,
              "defaultUser": self.default_user, "defaultWorkdir": self.default_workdir}
        if st == self._saved_state:
            return
        self._saved_state = st
        try:
            os.makedirs(os.path.dirname(STATE_FILE), mode=0o700, exist_ok=True)
            tmp = STATE_FILE + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(st, f)
            os.replace(tmp, STATE_FILE)
        except OSError as exc:
            log(f"init: cannot save the agent state: {exc}")

    @staticmethod
    def _add_entropy(data: bytes) -> None:
        """Mix host entropy into the kernel RNG and force a CRNG reseed: after a snapshot restore
        every clone would otherwise produce the same "random" numbers. Python's own ``random``
        module is reseeded for the same reason."""
        try:
            fd = os.open("/dev/random", os.O_WRONLY)
            try:
                fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(data) * 8, len(data)) + data)
                fcntl.ioctl(fd, RNDRESEEDCRNG, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            log(f"init: cannot add entropy to the kernel RNG: {exc}")
        random.seed(os.urandom(32) + data)

    # ---- filesystem RPCs ----------------------------------------------------------------

    async def rpc_stat(self, msg: dict, ctx: CallContext) -> dict:
        return {"entry": await blocking(entry_info, self.resolve(msg.get("path"), ctx.user()))}

    async def rpc_list_dir(self, msg: dict, ctx: CallContext) -> dict:
        depth = int(msg.get("depth") or 1)
        entries = await blocking(list_dir, self.resolve(msg.get("path"), ctx.user()), depth)
        return {"entries": entries} if entries else {}

    async def rpc_make_dir(self, msg: dict, ctx: CallContext) -> dict:
        user = ctx.user()
        return {"entry": await blocking(make_dir, self.resolve(msg.get("path"), user), user)}

    async def rpc_move(self, msg: dict, ctx: CallContext) -> dict:
        user = ctx.user()
        src, dst = self.resolve(msg.get("source"), user), self.resolve(msg.get("destination"), user)
        return {"entry": await blocking(move, src, dst, user)}

    async def rpc_remove(self, msg: dict, ctx: CallContext) -> dict:
        await blocking(remove, self.resolve(msg.get("path"), ctx.user()))
        return {}

    # ---- /files -------------------------------------------------------------------------

    def _files_auth(self, req: Request, operation: str) -> User:
        """A valid X-Access-Token header, or else a valid ``v1_`` URL signature (§4.7)."""
        token = self.access_token
        if token is not None:
            header = req.headers.get("x-access-token")
            if header is not None:
                if not hmac.compare_digest(header.encode(), token.encode()):
                    raise HttpError(401, "unauthorized access, please provide a valid access token")
            else:
                q = req.query
                raw = f"{q.get('path', '')}:{operation}:{q.get('username', '')}:{token}"
                if q.get("signature_expiration"):
                    raw += f":{q['signature_expiration']}"
                expected = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")
                if not hmac.compare_digest(q.get("signature", "").encode(), expected.encode()):
                    raise HttpError(401, "missing or invalid signature")
                expiration = q.get("signature_expiration")
                if expiration and (not expiration.isdigit() or int(expiration) < time.time()):
                    raise HttpError(401, "signature is already expired")
        name = req.query.get("username") or self.default_user
        user = lookup_user(name)
        if user is None:
            raise HttpError(401, f"invalid username: '{name}'")
        return user

    async def download(self, req: Request, resp: Response, user: User) -> None:
        path = self.resolve(req.query.get("path", ""), user)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # NONBLOCK: FIFOs
        except FileNotFoundError:
            raise HttpError(404, f"path '{path}' does not exist") from None
        except OSError as exc:
            raise HttpError(400, f"cannot open '{path}': {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise HttpError(400, f"path '{path}' is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise HttpError(400, f"path '{path}' is not a regular file")
            name = os.path.basename(path).replace('"', "")
            await resp.start(200, {"Content-Type": "application/octet-stream",
                                   "Content-Disposition": f'inline; filename="{name}"'}, st.st_size)
            sent = 0
            while sent < st.st_size:
                data = await blocking(os.pread, fd, min(FILE_CHUNK, st.st_size - sent), sent)
                if not data:  # the file shrank: we cannot honour Content-Length; drop the connection
                    resp.keep_alive = False
                    return
                await resp.write(data)
                sent += len(data)
        finally:
            os.close(fd)

    async def upload(self, req: Request, resp: Response, user: User) -> None:
        ctype = req.headers.get("content-type", "")
        gzipped = req.headers.get("content-encoding", "").lower() == "gzip"
        query_path = req.query.get("path")
        written = []
        try:
            if ctype.lower().startswith("multipart/form-data"):
                boundary = disposition_params(ctype).get("boundary")
                if not boundary:
                    raise HttpError(400, "multipart body without boundary")
                async for headers, body in Multipart(req.chunks(), boundary).parts():
                    params = disposition_params(headers.get("content-disposition", ""))
                    if params.get("name") == "file":
                        dest = query_path or params.get("filename")
                        if not dest:
                            raise HttpError(400, "no path query parameter and no part filename")
                        written.append(await self.store(dest, body, user, gzipped))
                await req.drain()  # the epilogue after the closing boundary
            else:
                if not query_path:
                    raise HttpError(400, "the path query parameter is required")
                written.append(await self.store(query_path, req.chunks(), user, gzipped))
        except HttpError:
            await req.drain()  # read the rest so the client gets our answer, not a reset
            raise
        await resp.send_json(200, written)

    async def store(self, dest: str, chunks: AsyncIterator[bytes], user: User, gzipped: bool) -> dict:
        """Stream one upload into a temp file next to the target, then rename it into place, so
        a failed or interrupted upload never leaves a partial file behind."""
        path = self.resolve(dest, user)
        if os.path.isdir(path):
            raise HttpError(400, f"path '{path}' is a directory")
        fd, tmp = -1, None
        try:
            await blocking(make_dirs, os.path.dirname(path), user)
            fd, tmp = await blocking(tempfile.mkstemp, ".upload", f".{os.path.basename(path)}.",
                                     os.path.dirname(path))
            inflate = zlib.decompressobj(wbits=31) if gzipped else None
            buf = bytearray()
            async for data in chunks:
                buf += inflate.decompress(data) if inflate else data
                if len(buf) >= FILE_CHUNK:
                    await blocking(write_all, fd, bytes(buf))
                    buf.clear()
            if inflate:
                buf += inflate.flush()
            await blocking(write_all, fd, bytes(buf))
            await blocking(install_file, fd, tmp, path, user, self.umask)
            tmp = None  # it is the final file now
        except zlib.error:
            raise HttpError(400, "invalid gzip body") from None
        except ConnectionError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HttpError(507, "not enough disk space") from None
            raise HttpError(400 if exc.errno in (errno.ENOTDIR, errno.EISDIR) else 500,
                            f"cannot write '{path}': {exc.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return {"path": path, "name": os.path.basename(path), "type": "file"}

    # ---- connection loop ----------------------------------------------------------------

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve keep-alive requests on one connection until it closes or becomes unusable."""
        try:
            while True:
                try:
                    req = await read_request(reader, writer)
                except (HttpError, ValueError) as exc:  # ValueError: line over the buffer limit
                    msg = exc.message if isinstance(exc, HttpError) else "request head too large"
                    await Response(writer, False).send_json(400, {"code": 400, "message": msg})
                    return
                if req is None:
                    return
                resp = Response(writer, req.keep_alive)
                try:
                    await self.dispatch(req, resp)
                    await resp.write(b"")  # a head still held back (a response with no body)
                except HttpError as exc:
                    if resp.started:
                        return
                    if not req.body_done:
                        resp.keep_alive = False
                    await resp.send_json(exc.status, {"code": exc.status, "message": exc.message})
                except (ConnectionError, asyncio.IncompleteReadError):
                    return
                except Exception as exc:
                    log(f"{req.method} {req.path} failed: {traceback.format_exc()}")
                    if resp.started:
                        return
                    resp.keep_alive = False
                    await resp.send_json(500, {"code": 500, "message": str(exc)})
                if not (resp.keep_alive and req.body_done):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def become_subreaper() -> None:
    """Adopt orphaned descendants so the SIGCHLD handler can reap them (no zombie build-up)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")


async def serve(host: str, port: int) -> None:
    agent = Agent()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGCHLD, agent.procs.reap)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = await asyncio.start_server(agent.handle_connection, host, port, reuse_address=True,
                                        limit=256 * 1024)
    log(f"listening on {host}:{port} (default user {agent.default_user})")
    async with server:
        while not stop.is_set():
            try:  # belt and braces: signals can be coalesced, so also reap periodically
                await asyncio.wait_for(stop.wait(), 5.0)
            except TimeoutError:
                agent.procs.reap()
    log("stopping")


def main() -> None:
    parser = argparse.ArgumentParser(description="AgentENV guest agent (envd-compatible)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args()
    become_subreaper()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
