#!/usr/bin/env python3
"""AgentENV code-interpreter server: the in-sandbox HTTP server (port 49999) that the official
``e2b-code-interpreter`` SDK talks to.

It runs inside the sandbox on the image's own ``python3`` and uses the standard library only; it
imports nothing from ``agentenv`` (it is copied into the template as plain files, with
``kernel.py`` beside it).

Routes (E2B's contract): ``GET /health``; ``POST /execute`` (streaming NDJSON);
``POST /contexts``, ``GET /contexts``, ``POST /contexts/{id}/restart``, ``DELETE /contexts/{id}``.

Design:

* Each context owns one kernel: a ``python3 -u kernel.py`` worker process started in the context's
  cwd, fed JSON-line commands on one pipe and answering JSON-line messages on another; its fds 1
  and 2 are pipes too, forwarded line by line as ``stdout``/``stderr`` lines. State lives in the
  worker, so contexts are isolated; restart = kill + respawn; delete = kill.
* One execution per context at a time (a lock; later requests queue behind it). The request's
  thread runs the execution itself: one ``select`` over the worker's three pipes and the client's
  socket, so output is forwarded as soon as it appears and a client that hangs up (or times out)
  is seen at once. Then the worker gets SIGINT (``KeyboardInterrupt`` in the cell); if the cell
  does not stop within a grace period the worker is killed and respawned. Either way the context
  stays usable.
* ``http.server.ThreadingHTTPServer`` speaking HTTP/1.1 with keep-alive; ``TCP_NODELAY`` so the
  small NDJSON chunks are not held back by Nagle's algorithm.
"""

from __future__ import annotations

import argparse
import codecs
import datetime
import errno
import fcntl
import http.client
import http.server
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid

KERNEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.py")
KEEPALIVE_S = 5.0  # a keepalive line after this much silence
PARTIAL_LINE_S = 0.1  # an unterminated line is sent after this long without its newline
INTERRUPT_GRACE_S = 3.0  # a cell that survives SIGINT this long gets its kernel restarted
ENVD_URL = os.environ.get("AENV_CI_ENVD_URL", "http://localhost:49983")
PYTHON = os.environ.get("AENV_CI_PYTHON", sys.executable or "python3")


def log(msg: str) -> None:
    sys.stderr.write(f"{datetime.datetime.now().isoformat(timespec='milliseconds')} code-interpreter: {msg}\n")
    sys.stderr.flush()


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def default_cwd() -> str:
    return "/home/user" if os.path.isdir("/home/user") else "/"


def normalize_language(language: object) -> str | None:
    """``None`` and ``python`` (any case) mean Python; anything else is unsupported (None)."""
    if language is None or (isinstance(language, str) and language.strip().lower() in ("", "python", "python3")):
        return "python"
    return None


class KernelDied(Exception):
    pass


class Kernel:
    """One worker process and the pipes to it."""

    def __init__(self, cwd: str) -> None:
        cmd_r, self.cmd_w = os.pipe()
        self.msg_r, msg_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [PYTHON, "-u", KERNEL, str(cmd_r), str(msg_w)], cwd=cwd, pass_fds=(cmd_r, msg_w),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except BaseException:
            for fd in (self.cmd_w, self.msg_r):
                os.close(fd)
            raise
        finally:
            os.close(cmd_r)
            os.close(msg_w)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out_fd, self.err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        for fd in (self.msg_r, self.out_fd, self.err_fd):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.msg_buf = b""
        self.next_id = 0
        self.dead = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def interrupt(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Kill the worker and everything it started (its own session)."""
        self.dead = True
        for target in (lambda: os.killpg(self.proc.pid, signal.SIGKILL), lambda: self.proc.kill()):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.close()

    def close(self) -> None:
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for fd in (self.cmd_w, self.msg_r):
            try:
                os.close(fd)
            except OSError:
                pass

    def wait_ready(self, timeout: float) -> bool:
        """True once the worker has started (its "ready" line is readable; drained later)."""
        return bool(select.select([self.msg_r], [], [], timeout)[0])

    def drain_stale(self) -> None:
        """Discard output left over from earlier cells (e.g. background threads)."""
        for fd in (self.out_fd, self.err_fd, self.msg_r):
            while _read(fd):
                pass
        self.msg_buf = b""

    def send(self, cmd: dict) -> None:
        data = (json.dumps(cmd) + "\n").encode()
        while data:
            data = data[os.write(self.cmd_w, data):]


def _read(fd: int) -> bytes | None:
    """Non-blocking read: data, b"" at EOF, None when nothing is available now."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EBADF, errno.EIO):
            return b""
        raise


class LineBuffer:
    """Turns a byte stream into ``stdout``/``stderr`` lines, each with the newline it ended with."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.partial = ""
        self.partial_since = 0.0

    def feed(self, data: bytes) -> list[dict]:
        return self.feed_text(self.decoder.decode(data))

    def feed_text(self, text: str) -> list[dict]:
        text = self.partial + text
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith(("\n", "\r")):
            if not self.partial:
                self.partial_since = time.monotonic()
            self.partial = lines.pop()
        else:
            self.partial = ""
        return [self._line(t) for t in lines]

    def flush(self) -> list[dict]:
        text, self.partial = self.partial + self.decoder.decode(b"", final=True), ""
        return [self._line(text)] if text else []

    def _line(self, text: str) -> dict:
        return {"type": self.kind, "text": text, "timestamp": now_iso()}


class Context:
    def __init__(self, language: str, cwd: str) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.exec_lock = threading.Lock()  # one execution at a time
        self.state_lock = threading.Lock()  # guards kernel replacement
        self.deleted = False
        self.kernel = Kernel(cwd)

    def info(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self) -> None:
        with self.state_lock:
            old, self.kernel = self.kernel, Kernel(self.cwd)
        old.kill()

    def replace_if(self, kernel: Kernel) -> None:
        """Respawn after ``kernel`` died or was killed, unless someone already replaced it."""
        with self.state_lock:
            if self.deleted or self.kernel is not kernel:
                return
            self.kernel = Kernel(self.cwd)
        kernel.kill()
        log(f"context {self.id}: kernel restarted (pid {self.kernel.pid})")

    def delete(self) -> None:
        with self.state_lock:
            self.deleted = True
        self.kernel.kill()


class Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}  # language -> context id

    def create(self, language: str, cwd: str) -> Context:
        ctx = Context(language, cwd)
        with self.lock:
            self.contexts[ctx.id] = ctx
        log(f"context {ctx.id} created (language {language}, cwd {cwd}, kernel pid {ctx.kernel.pid})")
        return ctx

    def get(self, context_id: str) -> Context | None:
        with self.lock:
            return self.contexts.get(context_id)

    def default(self, language: str) -> Context:
        with self.lock:
            ctx = self.contexts.get(self.defaults.get(language, ""))
            if ctx is None:
                ctx = Context(language, default_cwd())
                self.contexts[ctx.id] = ctx
                self.defaults[language] = ctx.id
                log(f"default {language} context {ctx.id} created (kernel pid {ctx.kernel.pid})")
            return ctx

    def remove(self, context_id: str) -> Context | None:
        with self.lock:
            ctx = self.contexts.pop(context_id, None)
            for lang, cid in list(self.defaults.items()):
                if cid == context_id:
                    del self.defaults[lang]
        return ctx

    def list(self) -> list[dict]:
        with self.lock:
            return [c.info() for c in self.contexts.values()]

    def shutdown(self) -> None:
        with self.lock:
            contexts = list(self.contexts.values())
        for ctx in contexts:
            ctx.delete()


REGISTRY = Registry()


class EnvdEnvs:
    """Sandbox-wide env vars from envd (``GET /envs``, set at sandbox creation) over a kept-alive
    connection. Failures give {}; after a refused connection envd is not asked again for a second
    (no envd, e.g. on a test host)."""

    def __init__(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "localhost", parsed.port or 80
        self.lock = threading.Lock()
        self.conn: http.client.HTTPConnection | None = None
        self.refused_until = 0.0

    def get(self, access_token: str | None) -> dict[str, str] | None:
        """The env vars; None when envd refuses ``access_token`` (401/403): the caller is not
        the sandbox's owner, and may run no code (envd checks the token it handed out)."""
        if time.monotonic() < self.refused_until:
            return {}
        headers = {"X-Access-Token": access_token} if access_token else {}
        with self.lock:
            for attempt in (0, 1):  # a kept-alive connection may have been closed by envd
                try:
                    if self.conn is None:
                        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
                    self.conn.request("GET", "/envs", headers=headers)
                    resp = self.conn.getresponse()
                    body = resp.read()
                    if resp.status in (401, 403):
                        return None
                    if resp.status != 200:
                        return {}
                    data = json.loads(body or b"{}")
                    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
                except ConnectionRefusedError:
                    self._drop()
                    self.refused_until = time.monotonic() + 1.0
                    return {}
                except (OSError, http.client.HTTPException, ValueError):
                    self._drop()
                    if attempt:
                        return {}
        return {}

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


ENVD = EnvdEnvs(ENVD_URL)


class ClientGone(Exception):
    pass


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentenv-code-interpreter/1"
    timeout = 640  # idle keep-alive connections, like E2B's server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:
        if os.environ.get("AENV_CI_ACCESS_LOG"):
            log(format % args)

    # --- plumbing -----------------------------------------------------------------------------

    def _reply(self, status: int, body: object, content_type: str = "application/json") -> None:
        data = (json.dumps(body) if content_type == "application/json" else str(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type + ("; charset=utf-8" if content_type.startswith("text/") else ""))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _text(self, status: int, text: str) -> None:
        self._reply(status, text, "text/plain")

    def _body(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError:
            self._text(400, "request body is not valid JSON")
            return None
        if not isinstance(body, dict):
            self._text(400, "request body must be a JSON object")
            return None
        return body

    def _path(self) -> list[str]:
        return [p for p in self.path.split("?", 1)[0].split("/") if p]

    # --- routes -------------------------------------------------------------------------------

    def do_GET(self) -> None:
        parts = self._path()
        if parts == ["health"]:
            self._reply(200, "OK")
        elif parts == ["contexts"]:
            self._reply(200, REGISTRY.list())
        else:
            self._text(404, f"Not found: GET {self.path}")

    def do_POST(self) -> None:
        parts = self._path()
        if parts == ["execute"]:
            self._execute()
        elif parts == ["contexts"]:
            self._create_context()
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            self._drain_body()
            ctx = REGISTRY.get(parts[1])
            if ctx is None:
                self._text(404, f"Context {parts[1]} not found")
                return
            ctx.restart()
            log(f"context {ctx.id} restarted (kernel pid {ctx.kernel.pid})")
            self._reply(200, ctx.info())
        else:
            self._drain_body()
            self._text(404, f"Not found: POST {self.path}")

    def do_DELETE(self) -> None:
        parts = self._path()
        self._drain_body()
        if len(parts) == 2 and parts[0] == "contexts":
            ctx = REGISTRY.remove(parts[1])
            if ctx is None:
                self._text(404, f"Context {parts[1]} not found")
                return
            ctx.delete()
            log(f"context {ctx.id} deleted")
            self._reply(200, None)
        else:
            self._text(404, f"Not found: DELETE {self.path}")

    def _drain_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)

    def _create_context(self) -> None:
        body = self._body()
        if body is None:
            return
        language = normalize_language(body.get("language"))
        if language is None:
            self._text(400, f"Unsupported language {body.get('language')!r}: this sandbox runs only 'python'")
            return
        cwd = body.get("cwd") or default_cwd()
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            self._text(400, f"cwd {cwd!r} is not an existing directory")
            return
        try:
            ctx = REGISTRY.create(language, cwd)
        except OSError as exc:
            self._text(500, f"cannot start a kernel: {exc}")
            return
        self._reply(200, ctx.info())

    def _execute(self) -> None:
        body = self._body()
        if body is None:
            return
        code, context_id, language = body.get("code"), body.get("context_id"), body.get("language")
        env_vars = body.get("env_vars") or {}
        if not isinstance(code, str):
            self._text(400, "'code' must be a string")
            return
        if context_id and language:
            self._text(400, "Only one of context_id or language can be provided")
            return
        if not isinstance(env_vars, dict):
            self._text(400, "'env_vars' must be an object")
            return
        # Running code needs the sandbox's envd access token, as every envd route does: the
        # proxy lets anyone who knows a sandbox's id reach this port.
        sandbox_env = ENVD.get(self.headers.get("X-Access-Token"))
        if sandbox_env is None:
            self._text(401, "invalid or missing access token: send the sandbox's envd access token as X-Access-Token")
            return
        if context_id:
            ctx = REGISTRY.get(context_id)
            if ctx is None:
                self._text(404, f"Context {context_id} not found")
                return
        else:
            lang = normalize_language(language)
            if lang is None:
                self._text(400, f"Unsupported language {language!r}: this sandbox runs only 'python'")
                return
            ctx = REGISTRY.default(lang)
        env = {**sandbox_env, **{str(k): str(v) for k, v in env_vars.items()}}

        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        stream = Stream(self)
        try:
            run_execution(ctx, code, env, stream)
        finally:
            if not stream.flush(final=True):
                self.close_connection = True


class Stream:
    """The response side of one /execute: chunked NDJSON writes plus hang-up detection.

    Lines are queued and written together by ``flush()``, which the execution loop calls before
    it waits: what is ready at once (count, result, end) leaves in one write, anything produced
    later leaves as soon as the loop would block."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sock: socket.socket = handler.connection
        self.alive = True
        self.last_write = time.monotonic()
        self.pending: list[bytes] = []

    def send(self, obj: dict) -> bool:
        if not self.alive:
            return False
        line = json.dumps(obj).encode() + b"\n"
        self.pending.append(b"%x\r\n%s\r\n" % (len(line), line))
        self.last_write = time.monotonic()
        return True

    def flush(self, final: bool = False) -> bool:
        if final:
            self.pending.append(b"0\r\n\r\n")
        if self.alive and self.pending:
            try:
                self.handler.wfile.write(b"".join(self.pending))
            except OSError:
                self.alive = False
        self.pending.clear()
        return self.alive

    def check_hangup(self) -> bool:
        """True if the client closed its side (an HTTP/1.1 client sends nothing while it waits)."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            self.alive = False
            return True
        if data == b"":
            self.alive = False
            return True
        return False


def run_execution(ctx: Context, code: str, env: dict[str, str], stream: Stream) -> None:
    # Wait for the context's previous execution, keeping the client informed.
    while not ctx.exec_lock.acquire(timeout=KEEPALIVE_S):
        stream.send({"type": "keepalive"})
        if not stream.flush():
            return
    try:
        if ctx.deleted:
            stream.send({"type": "error", "name": "ContextDeleted", "value": f"Context {ctx.id} was deleted",
                         "traceback": ""})
            return
        kernel = ctx.kernel
        if not kernel.alive():
            ctx.replace_if(kernel)
            kernel = ctx.kernel
        _run_on_kernel(ctx, kernel, code, env, stream)
    finally:
        ctx.exec_lock.release()
    stream.send({"type": "end_of_execution"})


def _run_on_kernel(ctx: Context, kernel: Kernel, code: str, env: dict[str, str], stream: Stream) -> None:
    kernel.drain_stale()
    kernel.next_id += 1
    exec_id = kernel.next_id
    buffers = {"stdout": LineBuffer("stdout"), "stderr": LineBuffer("stderr")}
    pipes = {kernel.out_fd: LineBuffer("stdout"), kernel.err_fd: LineBuffer("stderr")}  # fd-level output
    sel = selectors.DefaultSelector()
    for fd in (kernel.out_fd, kernel.err_fd, kernel.msg_r):
        sel.register(fd, selectors.EVENT_READ)
    sel.register(stream.sock, selectors.EVENT_READ)
    interrupted_at: float | None = None

    def emit(objs: list[dict]) -> None:
        for obj in objs:
            stream.send(obj)

    def pump_output(fd: int) -> bool:
        """Forward what the pipe holds now; False at EOF. A pipe already at its end (drained
        while an earlier event of the same select was handled) is left alone."""
        if fd not in sel.get_map():
            return False
        while True:
            data = _read(fd)
            if data is None:
                return True
            if data == b"":
                emit(buffers[pipes[fd].kind].flush())
                sel.unregister(fd)
                return False
            emit(buffers[pipes[fd].kind].feed_text(pipes[fd].decoder.decode(data)))

    def hang_up() -> None:
        nonlocal interrupted_at
        try:
            sel.unregister(stream.sock)
        except (KeyError, ValueError):
            pass
        if interrupted_at is None:
            interrupted_at = time.monotonic()
            log(f"context {ctx.id}: client went away during execution {exec_id}; interrupting the kernel")
            kernel.interrupt()

    try:
        kernel.send({"id": exec_id, "code": code, "env": env})
    except OSError:
        kernel.dead = True
        stream.send({"type": "error", "name": "KernelDied", "value": "The kernel is not running; it was restarted",
                     "traceback": ""})
        ctx.replace_if(kernel)
        return
    try:
        while True:
            now = time.monotonic()
            timeout = KEEPALIVE_S - (now - stream.last_write) if stream.alive else INTERRUPT_GRACE_S
            for buf in buffers.values():
                if buf.partial:
                    timeout = min(timeout, buf.partial_since + PARTIAL_LINE_S - now)
            if interrupted_at is not None:
                timeout = min(timeout, interrupted_at + INTERRUPT_GRACE_S - now)
            stream.flush()
            events = sel.select(max(timeout, 0.0))
            for key, _ in events:
                fd = key.fd
                if key.fileobj is stream.sock:
                    if stream.check_hangup():
                        hang_up()
                    else:
                        sel.unregister(stream.sock)  # a pipelined request: stop watching
                elif fd in pipes:
                    pump_output(fd)
                else:
                    data = _read(fd)
                    if data is None:
                        continue
                    if data == b"":
                        raise KernelDied
                    kernel.msg_buf += data
                    *lines, kernel.msg_buf = kernel.msg_buf.split(b"\n")
                    for raw in lines:
                        msg = json.loads(raw)
                        if msg.pop("id", None) != exec_id:
                            continue  # from an earlier, interrupted cell
                        for out_fd in pipes:  # what subprocesses printed before this message
                            if out_fd in sel.get_map():
                                pump_output(out_fd)
                        kind = msg["type"]
                        if kind in buffers:
                            emit(buffers[kind].feed_text(msg.get("text", "")))
                            continue
                        for buf in buffers.values():  # a result or error ends the lines before it
                            emit(buf.flush())
                        if kind == "done":
                            return
                        stream.send(msg)
            now = time.monotonic()
            for buf in buffers.values():
                if buf.partial and now - buf.partial_since >= PARTIAL_LINE_S:
                    emit(buf.flush())
            if not stream.alive:
                hang_up()
            if interrupted_at is not None and now - interrupted_at >= INTERRUPT_GRACE_S:
                log(f"context {ctx.id}: execution {exec_id} ignored the interrupt; restarting the kernel")
                ctx.replace_if(kernel)
                return
            if stream.alive and now - stream.last_write >= KEEPALIVE_S:
                stream.send({"type": "keepalive"})
    except KernelDied:
        for fd in list(pipes):
            if fd in sel.get_map():
                pump_output(fd)
        for buf in buffers.values():
            emit(buf.flush())
        if ctx.deleted or ctx.kernel is not kernel:
            value = "The context was restarted or deleted during the execution"
        else:
            value = "The kernel died unexpectedly; it was restarted"
        stream.send({"type": "error", "name": "KernelDied", "value": value, "traceback": ""})
        ctx.replace_if(kernel)
    finally:
        sel.close()


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return  # clients hanging up are routine
        super().handle_error(request, client_address)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=49999)
    args = parser.parse_args(argv)
    started = time.monotonic()
    # Warm: /health answers only once the default kernel runs, so a template snapshot taken
    # after the ready check holds a started kernel and the first run_code does not wait for one.
    if not REGISTRY.default("python").kernel.wait_ready(30):
        log("the default kernel did not start within 30 s; serving anyway")
    server = Server((args.host, args.port), Handler)

    def stop(_signum: int, _frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"listening on {args.host}:{args.port} ({(time.monotonic() - started) * 1000:.0f} ms after start)")
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        REGISTRY.shutdown()
        server.server_close()
        log("stopped")


if __name__ == "__main__":
    main()
