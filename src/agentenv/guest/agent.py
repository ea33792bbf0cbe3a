#!/usr/bin/env python3
"""AgentENV guest agent: a small, stdlib-only implementation of E2B's *envd*.

It runs as root inside every sandbox microVM (restarted by the guest's shell init if it dies) and
serves, on TCP port 49983, the part of the envd protocol AgentENV needs: Connect RPC with the JSON
codec over HTTP/1.1 for the ``process.Process`` and ``filesystem.Filesystem`` services, plus the
plain HTTP routes ``/health``, ``/init``, ``/envs``, ``/metrics``, ``/files``, ``/files/compose``
and ``/sync`` (the host's, before a filesystem-only pause: flush every filesystem to disk).

Design notes (why it looks the way it does):

* The guest has nothing but Debian's ``python3``, so the agent uses only the stdlib. It is this
  entry point plus the modules of ``agentlib/`` next to it (HTTP, processes, filesystem helpers,
  watchers, metrics); all are copied into the image as they are (``images/rootfs.py``) and share
  no code with the host package.
* One asyncio event loop serves everything. Blocking work (directory walks, disk I/O of big files)
  goes to the default thread pool, so one slow request never stalls another command's output.
* Children are started by the tools drive's ``libaenvspawn.so`` (guest/spawn.c, called through
  ctypes): one vfork+exec, no Python in the child, which enters PID 1's mount namespace, the
  working directory, the user and the terminal, then execs the command. They are reaped by a
  single SIGCHLD handler calling ``waitpid(-1)``.
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
import hmac
import json
import os
import random
import re
import resource
import signal
import socket
import struct
import threading
import time
import traceback

from agentlib import metrics
from agentlib.common import (
    CONNECT_STATUS,
    CORS_HEADERS,
    MAX_CONTROL_MESSAGE,
    MAX_MESSAGE,
    CallContext,
    ConnectError,
    HttpError,
    User,
    blocking,
    envelope,
    field,
    log,
    lookup_user,
    parse_json_object,
    set_tools_dir,
    set_user_namespace,
)
from agentlib.files import FilesService
from agentlib.fsutil import (
    entry_info,
    list_dir,
    make_dir,
    move,
    remove,
)
from agentlib.httpio import Request, Response, read_envelopes, read_request
from agentlib.ports import PortForwarder
from agentlib.process import ProcessManager
from agentlib.watch import WatchService

DEFAULT_PORT = 49983
# Where /init writes the E2B marker files. Tests point this at a temporary directory.
RUN_DIR = os.environ.get("AENV_AGENT_RUN_DIR", "/run/e2b")
# Test-only switch: with AENV_AGENT_NO_CLOCK=1, /init does not set the wall clock. Only the test
# suite sets it, because it runs the agent directly on the host, whose clock must not be touched.
NO_CLOCK = os.environ.get("AENV_AGENT_NO_CLOCK") == "1"
# What /init set, kept (root-only, on the guest's tmpfs) so that an agent restarted by the init
# after a crash still enforces the access token and applies the sandbox's env vars.
STATE_FILE = os.environ.get("AENV_AGENT_STATE", "/run/aenv-agent/state.json")

# Unary calls that carry a process's input: their messages may be as large as MAX_MESSAGE.
INPUT_RPCS = frozenset({"process.Process/SendInput"})
MAX_WALKS = 2  # ListDir walks at once (asyncio's default thread pool has cpus + 4 threads)
WALK_POLL_S = 0.5  # how often a running walk checks for its client and deadline

RNDADDENTROPY = 0x40085203      # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207          # _IO('R', 0x07)
PR_SET_CHILD_SUBREAPER = 36

# --------------------------------------------------------------------------------------------
# The agent: state, routing, RPC dispatch
# --------------------------------------------------------------------------------------------



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
        self.procs = ProcessManager(self)
        self.files = FilesService(self)
        self.ports = PortForwarder()
        self._walks = asyncio.Semaphore(MAX_WALKS)  # ListDir walks running in threads at once
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
        self.watches = WatchService(self.resolve)
        self.unary.update({
            "filesystem.Filesystem/CreateWatcher": self.watches.rpc_create_watcher,
            "filesystem.Filesystem/GetWatcherEvents": self.watches.rpc_get_watcher_events,
            "filesystem.Filesystem/RemoveWatcher": self.watches.rpc_remove_watcher,
        })
        self.streams = {"process.Process/Start": self.procs.rpc_start,
                        "process.Process/Connect": self.procs.rpc_connect,
                        "filesystem.Filesystem/WatchDir": self.watches.rpc_watch_dir}
        self.client_streams = {"process.Process/StreamInput": self.procs.rpc_stream_input}

    def resolve(self, path: str, user: User) -> str:
        """``~`` is the user's home; relative paths start at the default workdir, else the home.

        ``..`` is resolved as the kernel resolves it: against the directory the preceding part
        really is (after following its symlinks), not by textual clean-up. Other components stay
        as given, so a final symlink is still reported as itself."""
        path = str(path or "")
        if "\0" in path:
            raise ConnectError("invalid_argument", "path contains a NUL byte")
        if path == "~" or path.startswith("~/"):
            path = user.home + path[1:]
        elif not path.startswith("/"):
            path = os.path.join(self.default_workdir or user.home, path)
        parts = path.split("/")
        if ".." in parts:
            last = len(parts) - 1 - parts[::-1].index("..")
            path = os.path.join(os.path.realpath("/".join(parts[:last + 1])), *parts[last + 1:])
        return os.path.normpath(path)

    # ---- routing ------------------------------------------------------------------------

    async def dispatch(self, req: Request, resp: Response) -> None:
        path, method = req.path, req.method
        if method == "OPTIONS":
            return await resp.send(204, headers=CORS_HEADERS)
        if path == "/health" and method in ("GET", "HEAD"):
            return await resp.send(204)
        if path == "/files" and method in ("GET", "POST"):
            user = self.files.auth(req, "read" if method == "GET" else "write")
            return await (self.files.download(req, resp, user) if method == "GET"
                          else self.files.upload(req, resp, user))
        self._check_token(req)  # everything below needs the access token, when one is set
        if path == "/init" and method == "POST":  # (the first, before any token, is open)
            return await self.init(req, resp)
        if path == "/files/compose" and method == "POST":
            return await self.files.compose(req, resp)
        if path == "/sync" and method == "POST":  # the host, before a filesystem-only pause
            await blocking(os.sync)
            return await resp.send(204)
        if path == "/envs" and method == "GET":
            return await resp.send_json(200, self.env_vars, {"Cache-Control": "no-store"})
        if path == "/port-forward" and method == "POST":  # the host's proxy, for a closed port
            port = int(req.query.get("port", "0")) if req.query.get("port", "").isdigit() else 0
            if not 0 < port < 65536:
                raise HttpError(400, "port must be a TCP port number")
            bind = req.writer.get_extra_info("sockname")[0]
            return await resp.send_json(200, {"forwarding": await self.ports.ensure(port, bind)})
        if path == "/metrics" and method == "GET":
            return await resp.send_json(200, await blocking(metrics.collect), {"Cache-Control": "no-store"})
        if re.fullmatch(r"/[\w.]+\.\w+/\w+", path):
            if method != "POST":
                raise HttpError(405, "method not allowed")
            return await self.rpc(req, resp)
        raise HttpError(404, f"no route for {method} {path}")

    def _check_token(self, req: Request) -> None:
        if self.access_token is not None and not hmac.compare_digest(
                req.headers.get("x-access-token", "").encode(), self.access_token.encode()):
            raise HttpError(401, "unauthorized access, please provide a valid access token")

    async def rpc(self, req: Request, resp: Response) -> None:
        """Connect protocol: unary calls answer JSON; server streams answer 5-byte envelopes
        (flags, big-endian length, JSON) and always finish with an end-stream envelope (0x02)."""
        name = req.path[1:]
        if name in self.client_streams:
            return await self._client_stream(name, req, resp)
        if name in self.streams:
            await resp.start(200, {"Content-Type": "application/connect+json"})
            end: dict = {}
            stream = None
            held = b""
            try:
                body = await req.read_body(MAX_CONTROL_MESSAGE)
                if len(body) < 5 or len(body) != 5 + struct.unpack(">I", body[1:5])[0] or body[0] & 1:
                    raise ConnectError("invalid_argument", "malformed Connect envelope")
                msg = parse_json_object(body[5:])
                ctx = CallContext(self.default_user, req.headers)
                ctx.client_gone = lambda: req.reader.at_eof() or req.writer.is_closing()
                stream = self.streams[name](msg, ctx)
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
                code = "resource_exhausted" if exc.status == 413 else "invalid_argument"
                end = {"error": {"code": code, "message": exc.message}}
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
            body = await req.read_body(MAX_MESSAGE if name in INPUT_RPCS else MAX_CONTROL_MESSAGE)
            if name not in self.unary:
                raise ConnectError("unimplemented", f"{name} is not implemented")
            ctx = CallContext(self.default_user, req.headers)
            ctx.client_gone = lambda: req.reader.at_eof() or req.writer.is_closing()
            out = await self.unary[name](parse_json_object(body), ctx)
            await resp.send_json(200, out)
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as exc:  # every failure is a Connect error the SDKs can parse
            err = connect_error_of(exc)
            if err.code == "internal":
                log(f"{name} failed: {traceback.format_exc()}")
            await resp.send_json(CONNECT_STATUS.get(err.code, 500), {"code": err.code, "message": err.message})

    async def _client_stream(self, name: str, req: Request, resp: Response) -> None:
        """A client-streaming call: the request body is a stream of envelopes, read as they come;
        the answer is one envelope and the end-stream envelope (or only an error end-stream)."""
        end: dict = {}
        out = None
        try:
            out = await self.client_streams[name](read_envelopes(req.chunks()),
                                                  CallContext(self.default_user, req.headers))
        except ConnectError as exc:
            end = {"error": {"code": exc.code, "message": exc.message}}
        except HttpError as exc:
            end = {"error": {"code": "invalid_argument", "message": exc.message}}
        # After an early error, read (and drop) the rest of the stream so that the client, which
        # sends its whole body before reading the answer, gets the error and not a reset.
        await req.drain()
        await resp.start(200, {"Content-Type": "application/connect+json"})
        await resp.finish((envelope(0, out) if out is not None else b"") + envelope(2, end))

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
        """A deep walk can take minutes in a thread that cannot be cancelled: at most
        ``MAX_WALKS`` at once (the rest of the agent's blocking work keeps threads of its
        own), and each one ends when its client goes or its Connect deadline passes."""
        depth = int(msg.get("depth") or 1)
        path = self.resolve(msg.get("path"), ctx.user())
        deadline = time.monotonic() + ctx.timeout if ctx.timeout is not None else None
        stop = threading.Event()
        async with self._walks:
            walk = asyncio.ensure_future(blocking(list_dir, path, depth, stop))
            try:
                while not (await asyncio.wait({walk}, timeout=WALK_POLL_S))[0]:
                    if ctx.client_gone() or (deadline is not None and time.monotonic() > deadline):
                        stop.set()
                entries = await walk
            finally:
                stop.set()
        if deadline is not None and time.monotonic() > deadline:
            raise ConnectError("deadline_exceeded", f"listing '{path}' took longer than Connect-Timeout-Ms")
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

    # ---- connection loop ----------------------------------------------------------------

    async def handle_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve keep-alive requests on one connection until it closes or becomes unusable."""
        keep_probing(writer)
        try:
            while True:
                try:
                    req = await read_request(reader, writer)
                except (HttpError, ValueError) as exc:  # ValueError: a target urllib cannot split
                    if not isinstance(exc, HttpError):
                        exc = HttpError(400, "malformed request target")
                    await Response(writer, False).send_json(exc.status, {"code": exc.status, "message": exc.message})
                    return
                if req is None:
                    return
                resp = Response(writer, req.keep_alive)
                try:
                    await self.dispatch(req, resp)
                    await resp.write(b"")  # a head still held back (a response with no body)
                except (HttpError, ConnectError) as exc:
                    if isinstance(exc, ConnectError):  # e.g. a bad path given to /files
                        exc = HttpError(CONNECT_STATUS.get(exc.code, 500), exc.message)
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



def take_envds_name() -> None:
    """Go by envd's name, not the interpreter's: an agent in the sandbox that cleans up its own
    servers with ``pkill python`` or ``killall python3`` (as root, as many images run) must not
    kill this process, and with it the pipes and PTYs of every command it runs."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write("envd")
    except OSError as exc:
        log(f"cannot rename the agent's process: {exc}")


def become_subreaper() -> None:
    """Adopt orphaned descendants so the SIGCHLD handler can reap them (no zombie build-up)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")


_ERRNO_CODES = {
    errno.ENOENT: "not_found", errno.EEXIST: "already_exists", errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied", errno.ENOTDIR: "failed_precondition", errno.EISDIR: "failed_precondition",
    errno.ENOTEMPTY: "failed_precondition", errno.ENAMETOOLONG: "invalid_argument", errno.ELOOP: "invalid_argument",
    errno.ENOSPC: "resource_exhausted", errno.EDQUOT: "resource_exhausted",
}


def connect_error_of(exc: Exception) -> ConnectError:
    """The Connect error for a failure of a unary RPC handler: its own, a bad request (an HTTP
    error, a value that does not parse: ``invalid_argument``), a file system error by errno,
    else ``internal``."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, HttpError):
        return ConnectError("resource_exhausted" if exc.status == 413 else "invalid_argument", exc.message)
    if isinstance(exc, OSError):
        return ConnectError(_ERRNO_CODES.get(exc.errno or 0, "internal"), f"{exc.strerror or exc}: {exc.filename or ''}")
    if isinstance(exc, (ValueError, TypeError)):  # incl. UnicodeError: a name the kernel cannot take
        return ConnectError("invalid_argument", str(exc))
    return ConnectError("internal", str(exc))


def keep_probing(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on a client connection: a peer that vanished without a reset (its host or
    VM gone) is noticed after about 90 s, and a command streaming to it stops waiting for it,
    instead of the kernel's default of over two hours."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass


def raise_fd_limit() -> None:
    """Each connection, command and watcher holds descriptors; the guest's init leaves the
    limit at 1024, which a burst of connections or commands could exhaust. Commands inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            log(f"cannot raise the file descriptor limit: {exc}")


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
    parser.add_argument("--tools", default=None, help="the tools drive's mount point (lib/libaenvspawn.so, ...)")
    parser.add_argument("--user-ns", default=None, help="mount namespace file to start user processes in")
    args = parser.parse_args()
    set_tools_dir(args.tools)
    set_user_namespace(args.user_ns)
    take_envds_name()
    become_subreaper()
    raise_fd_limit()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
