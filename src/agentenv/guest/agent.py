#!/usr/bin/env python3
"""AgentENV guest agent: a small, stdlib-only implementation of E2B's *envd*.

It runs as root inside every sandbox microVM (restarted by the guest's shell init if it dies) and
serves, on TCP port 49983, the part of the envd protocol AgentENV needs: Connect RPC with the JSON
codec over HTTP/1.1 for the ``process.Process`` and ``filesystem.Filesystem`` services, plus the
plain HTTP routes ``/health``, ``/init``, ``/envs`` and ``/files``.

Design notes (why it looks the way it does):

* The guest has nothing but Debian's ``python3``, so the agent uses only the stdlib. It is this
  entry point plus the modules of ``agentlib/`` next to it (HTTP, processes, filesystem helpers,
  watchers, metrics); all are copied into the image as they are (``images/rootfs.py``) and share
  no code with the host package.
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
import contextlib
import ctypes
import datetime
import errno
import fcntl
import hashlib
import hmac
import json
import os
import random
import re
import signal
import socket
import stat
import struct
import time
import traceback
import urllib.parse
import zlib
from typing import Any, AsyncIterator

from agentlib import metrics
from agentlib.common import (
    CONNECT_STATUS,
    CORS_HEADERS,
    FILE_CHUNK,
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
)
from agentlib.fsutil import (
    Multipart,
    compose_files,
    disposition_params,
    entry_info,
    install_file,
    list_dir,
    make_dir,
    make_dirs,
    move,
    open_upload_target,
    remove,
    set_metadata,
    upload_metadata,
    write_all,
)
from agentlib.httpio import Request, Response, read_envelopes, read_request
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
            user = self._files_auth(req, "read" if method == "GET" else "write")
            return await (self.download(req, resp, user) if method == "GET" else self.upload(req, resp, user))
        if path == "/files/compose" and method == "POST":
            self._check_token(req)
            return await self.compose(req, resp)
        if path == "/init" and method == "POST":
            return await self.init(req, resp)
        self._check_token(req)
        if path == "/envs" and method == "GET":
            return await resp.send_json(200, self.env_vars, {"Cache-Control": "no-store"})
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
                body = await req.read_body()
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
            out = await self.unary[name](parse_json_object(body), CallContext(self.default_user, req.headers))
            await resp.send_json(200, out)
        except ConnectError as exc:
            await resp.send_json(CONNECT_STATUS.get(exc.code, 500), {"code": exc.code, "message": exc.message})

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
        """Stream a file in FILE_CHUNK pieces (bounded memory); gzip-compressed on the fly when the
        client accepts gzip (SDK ``files.read(gzip=True)``), else with its exact length."""
        path = self.resolve(req.query.get("path", ""), user)
        encoding = negotiate_encoding(req.headers.get("accept-encoding"))
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
            if encoding is None:
                raise HttpError(406, "no acceptable content encoding (gzip and identity are supported)")
            span = None if "if-range" in req.headers else byte_range(req.headers.get("range"), st.st_size)
            if span is not None:
                encoding = "identity"  # a range is of the file's bytes: serve them as they are
            headers = {"Content-Type": "application/octet-stream",
                       "Content-Disposition": content_disposition(os.path.basename(path)),
                       "Vary": "Accept-Encoding"}
            if encoding == "gzip":
                await resp.start(200, {**headers, "Content-Encoding": "gzip"})
                deflate = zlib.compressobj(6, zlib.DEFLATED, 31)
                offset = 0
                while offset < st.st_size:
                    data = await blocking(read_compressed, fd, offset, st.st_size - offset, deflate)
                    if data is None:
                        break  # the file shrank meanwhile: send what there is
                    offset += FILE_CHUNK
                    await resp.write(data)
                return await resp.finish(deflate.flush())
            headers["Accept-Ranges"] = "bytes"
            start, end = 0, st.st_size
            if span is not None:
                start, end = span
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
            await resp.start(206 if span else 200, headers, end - start)
            sent = start
            while sent < end:
                data = await blocking(os.pread, fd, min(FILE_CHUNK, end - sent), sent)
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
            metadata = upload_metadata(req.headers)
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
                        written.append(await self.store(dest, body, user, gzipped, metadata))
                await req.drain()  # the epilogue after the closing boundary
            else:
                if not query_path:
                    raise HttpError(400, "the path query parameter is required")
                written.append(await self.store(query_path, req.chunks(), user, gzipped, metadata))
        except HttpError:
            await req.drain()  # read the rest so the client gets our answer, not a reset
            raise
        await resp.send_json(200, written)

    async def compose(self, req: Request, resp: Response) -> None:
        """``POST /files/compose {source_paths, destination, username?}`` -> EntryInfo of the result."""
        body = parse_json_object(await req.read_body())
        name = field(body, "username") or self.default_user
        user = lookup_user(str(name))
        if user is None:
            raise HttpError(401, f"invalid username: '{name}'")
        sources, destination = field(body, "sourcePaths"), body.get("destination")
        if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
            raise HttpError(400, "source_paths must be a non-empty list of paths")
        if not isinstance(destination, str) or not destination:
            raise HttpError(400, "destination is required")
        dest = self.resolve(destination, user)
        try:
            await blocking(compose_files, [self.resolve(s, user) for s in sources], dest, user)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HttpError(507, f"not enough disk space to write '{dest}'") from None
            raise HttpError(500, f"cannot compose '{dest}': {exc.strerror}") from None
        await resp.send_json(200, await blocking(entry_info, dest))

    async def store(self, dest: str, chunks: AsyncIterator[bytes], user: User, gzipped: bool,
                    metadata: dict[str, str]) -> dict:
        """Stream one upload to disk with bounded memory. A failed or interrupted upload leaves
        nothing behind: a new file is deleted, an existing one keeps its old content (see
        ``open_upload_target``). ``metadata`` replaces the file's metadata xattrs."""
        path = self.resolve(dest, user)
        if os.path.isdir(path):
            raise HttpError(400, f"path '{path}' is a directory")
        fd, tmp, done, real_path = -1, None, False, path
        try:
            await blocking(make_dirs, os.path.dirname(path), user)
            fd, tmp, real_path = await blocking(open_upload_target, path, user)
            inflate = zlib.decompressobj(wbits=31) if gzipped else None
            buf = bytearray()
            async for data in chunks:
                if inflate:
                    # Bounded output per step, so a small "gzip bomb" cannot blow up memory.
                    buf += inflate.decompress(data, FILE_CHUNK)
                    while inflate.unconsumed_tail:
                        await blocking(write_all, fd, bytes(buf))
                        buf.clear()
                        buf += inflate.decompress(inflate.unconsumed_tail, FILE_CHUNK)
                else:
                    buf += data
                if len(buf) >= FILE_CHUNK:
                    await blocking(write_all, fd, bytes(buf))
                    buf.clear()
            if inflate:
                buf += inflate.flush()
                if not inflate.eof:
                    raise zlib.error("truncated gzip stream")
            await blocking(write_all, fd, bytes(buf))
            if metadata:
                await blocking(set_metadata, fd, metadata)
            if tmp is not None:
                await blocking(install_file, fd, tmp, real_path, user)
                tmp = None  # it is the final file now
            done = True
        except zlib.error:
            raise HttpError(400, "invalid gzip body") from None
        except ConnectionError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HttpError(507, f"not enough disk space to write '{path}'") from None
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP) and metadata:
                raise HttpError(400, f"the filesystem of '{path}' cannot store metadata (xattrs)") from None
            raise HttpError(400 if exc.errno in (errno.ENOTDIR, errno.EISDIR) else 500,
                            f"cannot write '{path}': {exc.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
            if not done and fd >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(tmp if tmp is not None else real_path)
        item = {"path": path, "name": os.path.basename(path), "type": "file"}
        if metadata:
            item["metadata"] = metadata
        return item

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


def negotiate_encoding(accept: str | None) -> str | None:
    """``gzip`` if the client accepts it, else ``identity`` unless refused (then None: 406)."""
    if not accept:
        return "identity"
    q: dict[str, float] = {}
    for item in accept.split(","):
        coding, _, params = item.strip().partition(";")
        weight = 1.0
        if (m := re.search(r"q\s*=\s*([0-9.]+)", params)) is not None:
            try:
                weight = float(m.group(1))
            except ValueError:
                weight = 0.0
        q[coding.strip().lower()] = weight
    if q.get("gzip", q.get("x-gzip", q.get("*", 0.0))) > 0:
        return "gzip"
    return "identity" if q.get("identity", q.get("*", 1.0)) > 0 else None


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single ``Range: bytes=a-b`` / ``a-`` / ``-n`` request; None serves the
    whole file (no header, several ranges, other units); unsatisfiable is 416."""
    if not header or not (m := re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)):
        return None
    first, last = m.group(1), m.group(2)
    if not first and not last:
        return None
    if not first:  # suffix: the last n bytes
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), min(size, int(last) + 1) if last else size
    if start >= size or start >= end:
        raise HttpError(416, f"range '{header}' not satisfiable for a file of {size} bytes")
    return start, end


def read_compressed(fd: int, offset: int, left: int, deflate: Any) -> bytes | None:
    """Read the next FILE_CHUNK of a file and compress it (thread pool: both are slow)."""
    data = os.pread(fd, min(FILE_CHUNK, left), offset)
    return deflate.compress(data) if data else None


def content_disposition(name: str) -> str:
    """``inline; filename="a.txt"``, with an RFC 6266 ``filename*`` for names that are not plain
    ASCII (HTTP headers cannot carry them raw)."""
    if name.isascii() and name.isprintable() and '"' not in name and "\\" not in name:
        return f'inline; filename="{name}"'
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name)
    quoted = urllib.parse.quote(os.fsencode(name), safe="")
    return f"inline; filename=\"{fallback}\"; filename*=UTF-8''{quoted}"


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
