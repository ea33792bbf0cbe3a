"""Shared pieces of the guest agent: constants, errors, JSON and Connect helpers."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import re
import shutil
import signal
import struct
import sys
import time
from typing import Any, Callable, NamedTuple

from .spawn import LIBRARY, Spawner

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OUTPUT_CHUNK = 32 * 1024        # max payload of one process data event (envd uses 32 KiB)
FILE_CHUNK = 1024 * 1024        # unit of disk and socket I/O for /files
MAX_MESSAGE = 16 * 1024 * 1024  # max size of one RPC message carrying a process's input
# ... and of any other: JSON of a few MiB already becomes hundreds of MiB of Python objects
# (a list of millions of args) in a guest of 512 MiB, parsed on the agent's only thread.
MAX_CONTROL_MESSAGE = 4 * 1024 * 1024
MAX_ARGS = 131072               # args + env vars of one command (the kernel takes 2 MiB in all)
UPLOAD_PREFIX = ".aenv-upload-"  # hidden temp files of uploads that replace an existing file
IDLE_TIMEOUT = 640.0            # keep-alive idle timeout, longer than the proxies' 610/620 s
# A request head, once begun, must be complete within this many seconds (tests shorten it).
HEAD_TIMEOUT = float(os.environ.get("AENV_AGENT_HEAD_TIMEOUT", "60"))
DEFAULT_KEEPALIVE = 90.0        # envd's default keepalive interval for streams
DISCONNECT_POLL = 1.0           # an idle server stream checks this often whether its client left
EXIT_GRACE = 1.0                # wait this long for pipes to close after the main process exits
FINISHED_TTL = 300.0            # finished processes stay visible to Process.Connect this long
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



async def blocking(fn: Callable, *args: Any) -> Any:
    """Run blocking filesystem work in the thread pool so the event loop stays responsive."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


_tools_dir: str | None = None  # the tools drive (``--tools``), None when run outside a sandbox
_user_ns: str | None = None  # the mount namespace user processes start in (``--user-ns``)
_spawner: Spawner | None = None


def set_tools_dir(path: str | None) -> None:
    global _tools_dir, _spawner
    _tools_dir, _spawner = path, None


def set_user_namespace(path: str | None) -> None:
    """The guest init passes PID 1's: the agent's own namespace has the tools drive, that one
    does not. None: user processes start in the agent's own."""
    global _user_ns, _spawner
    _user_ns, _spawner = path, None


def spawner() -> Spawner:
    """What starts user processes: the tools drive's ``lib/libaenvspawn.so``, loaded on first use."""
    global _spawner
    if _spawner is None:
        lib = os.path.join(_tools_dir or "", "lib", LIBRARY)
        if not _tools_dir or not os.path.exists(lib):
            raise ConnectError("internal", f"{LIBRARY} is missing from the tools drive")
        _spawner = Spawner(lib, _user_ns)
    return _spawner


def is_tool(path: str) -> bool:
    """Whether ``path`` is a program of the tools drive (which user processes cannot see)."""
    return bool(_tools_dir) and path.startswith(os.path.join(_tools_dir or "", ""))


_found: dict[tuple[str, str], str] = {}


def on_path(cmd: str, path: str) -> bool:
    """Whether an executable ``cmd`` is on ``path`` (the spawn library then finds it itself).
    Asked before every command; a PATH search is a stat per directory, ~20 us each under TCG,
    so the file found is remembered and only checked again (one access()) next time."""
    hit = _found.get((cmd, path))
    if hit is not None and os.access(hit, os.X_OK):
        return True
    found = shutil.which(cmd, path=path)
    if found is None:
        _found.pop((cmd, path), None)
        return False
    if len(_found) > 256:
        _found.clear()
    _found[(cmd, path)] = found
    return True


def fallback_shell(cmd: str, path: str) -> str | None:
    """What to run for ``cmd`` when it is bash and the image has none (alpine, busybox,
    distroless): SDKs always ask for ``/bin/bash -l -c``. The image's ``/bin/sh`` if it has
    one, else the tools drive's busybox shell. None when ``cmd`` is not bash or bash exists."""
    if os.path.basename(cmd) != "bash" or (on_path(cmd, path) if "/" not in cmd else os.path.exists(cmd)):
        return None
    if os.path.exists("/bin/sh"):
        return "/bin/sh"
    if _tools_dir and os.path.exists(os.path.join(_tools_dir, "bin", "busybox")):
        return os.path.join(_tools_dir, "bin", "sh")
    return None


class User(NamedTuple):
    name: str
    uid: int
    gid: int
    home: str
    groups: list[int]


_USER_DB = ("/etc/passwd", "/etc/group")
_USER_CACHE_S = 10.0  # bound for name services other than these files
_users: dict[str, tuple[Any, float, User | None]] = {}


def _user_db_version() -> tuple:
    out = []
    for path in _USER_DB:
        try:
            st = os.stat(path)
            out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def lookup_user(name: str) -> User | None:
    """The user's ids, home and groups. Every command asks; under TCG getpwnam + getgrouplist
    cost ~3 ms, so answers are kept while /etc/passwd and /etc/group are unchanged (useradd,
    usermod and chpasswd replace them), for at most _USER_CACHE_S."""
    version, now = _user_db_version(), time.monotonic()
    hit = _users.get(name)
    if hit is not None and hit[0] == version and now - hit[1] < _USER_CACHE_S:
        return hit[2]
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        user = None
    else:
        try:
            groups = os.getgrouplist(name, pw.pw_gid)
        except OSError:
            groups = [pw.pw_gid]
        user = User(name, pw.pw_uid, pw.pw_gid, pw.pw_dir, groups)
    if len(_users) > 256:
        _users.clear()
    _users[name] = (version, now, user)
    return user


class CallContext:
    """Per-RPC data: headers, Connect deadline, keepalive interval and the requested user.
    ``client_gone()`` tells an idle server stream that its client closed the connection."""

    @staticmethod
    def client_gone() -> bool:
        return False

    def __init__(self, default_user: str, headers: dict[str, str]) -> None:
        self.default_user, self.headers = default_user, headers
        try:
            ms = headers.get("connect-timeout-ms")
            self.timeout = int(ms) / 1000.0 if ms and int(ms) > 0 else None  # 0: no deadline, as envd
            self.keepalive = float(headers.get("keepalive-ping-interval") or DEFAULT_KEEPALIVE)
        except ValueError:
            raise ConnectError("invalid_argument", "invalid Connect-Timeout-Ms or Keepalive-Ping-Interval") from None
        # At most ten keepalives a second: a tiny interval would have the stream spin.
        self.keepalive = max(self.keepalive, 0.1) if self.keepalive > 0 else DEFAULT_KEEPALIVE

    def user(self) -> User:
        """The user from ``Authorization: Basic base64("<user>:")``, else the default user."""
        name = self.default_user
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
