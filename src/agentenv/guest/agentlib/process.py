"""The ``process.Process`` service: spawning, output fan-out, reaping, stdin, signals.

Children are spawned with ``subprocess.Popen`` and reaped by a single SIGCHLD handler calling
``waitpid(-1)``; the agent is a child subreaper, so the same handler also reaps orphaned
grandchildren. A process's output is fanned out to its subscribers (the Start stream, later
Connect streams) through bounded queues: a slow client back-pressures the process instead of
growing memory, and a client that goes away merely unsubscribes -- the process keeps running.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import os
import pty
import shutil
import signal
import struct
import subprocess
import termios
import time
from typing import Any, AsyncIterator, Callable

from .common import (
    DEFAULT_PATH,
    DISCONNECT_POLL,
    EXIT_GRACE,
    FINISHED_TTL,
    OUTPUT_CHUNK,
    SIGNALS,
    CallContext,
    ConnectError,
    b64decode,
    fallback_shell,
    log,
    tool,
    user_namespace,
)
from .fsutil import chown_to

STDIN_BUFFER = 256 * 1024  # StreamInput waits while more than this is queued for the process


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

    def __init__(self, agent: Any) -> None:  # the Agent of agent.py
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
        cmd = fallback_shell(cmd, env["PATH"]) or cmd
        argv_prefix: list[str] = []
        pty_cfg = msg.get("pty")
        switch = (user.uid, user.gid, set(user.groups)) != (os.geteuid(), os.getegid(), set(os.getgroups()))
        if switch and os.geteuid() != 0:
            raise ConnectError("permission_denied", "the agent is not root and cannot switch users")
        if (spawner := tool("aenv-spawn")) is not None:
            # In a sandbox: the tools drive's static helper enters PID 1's mount namespace (the
            # image without the tools drive), the working directory, the user and the terminal,
            # then execs the command; Popen still vforks (see guest/spawn.c).
            if "/" not in cmd and shutil.which(cmd, path=env["PATH"]) is None:
                raise ConnectError("internal", f"error starting process '{cmd}': no such executable")
            argv_prefix = [spawner]
            if (ns := user_namespace()) is not None:
                argv_prefix += ["--ns", ns, "--cwd", cwd]
            if switch:
                argv_prefix += ["--user", f"{user.uid}:{user.gid}:{','.join(str(g) for g in user.groups)}"]
            if isinstance(pty_cfg, dict):
                argv_prefix.append("--ctty")
            if cmd.startswith(os.path.dirname(spawner) + "/"):
                argv_prefix.append("--preopen")  # a tools-drive program (fallback shell): not in the user's view
            argv_prefix.append("--")
        elif not switch:
            pass  # no switch needed; leaving user= unset also lets Popen use the much faster vfork
        elif setpriv := tool("setpriv"):
            # setpriv switches user in the child's exec chain, so Popen can still vfork: a full
            # fork of this (Python) process is several times slower, most of all under TCG.
            if "/" not in cmd and shutil.which(cmd, path=env["PATH"]) is None:
                raise ConnectError("internal", f"error starting process '{cmd}': no such executable")
            groups = ",".join(str(g) for g in user.groups) or str(user.gid)
            argv_prefix = [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", f"--groups={groups}", "--"]
        else:
            kwargs.update(user=user.uid, group=user.gid, extra_groups=user.groups)
        argv, master = [*argv_prefix, cmd, *args], None
        try:
            if isinstance(pty_cfg, dict):
                master, slave = pty.openpty()
                size = pty_cfg.get("size") or {}
                set_winsize(master, size.get("cols", 80), size.get("rows", 24))
                chown_to(slave, user)
                # `setsid --ctty` makes the pty the controlling terminal without a preexec_fn.
                if spawner is not None:
                    pass  # --ctty above
                elif (setsid := tool("setsid")) is not None:
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
        last_sent = time.monotonic()
        try:
            while True:
                if getter is None and not sub.queue.empty():
                    # Fast path: the event is already there; no future, no timer (each costs
                    # measurable time when the guest is emulated).
                    event = sub.queue.get_nowait()
                    yield {"event": event}
                    if "end" in event:
                        return
                    last_sent = time.monotonic()
                    continue
                getter = getter or asyncio.ensure_future(sub.queue.get())
                now = time.monotonic()
                wait = min(last_sent + ctx.keepalive - now, DISCONNECT_POLL)
                if deadline is not None:
                    if (left := deadline - now) <= 0:
                        raise ConnectError("deadline_exceeded", "stream deadline exceeded")
                    wait = min(wait, left)
                done, _ = await asyncio.wait({getter}, timeout=max(wait, 0.0))
                if not done:
                    if ctx.client_gone():
                        return  # nobody to send to; the process itself keeps running
                    now = time.monotonic()
                    if now - last_sent >= ctx.keepalive and (deadline is None or now < deadline):
                        last_sent = now
                        yield {"event": {"keepalive": {}}}
                    continue
                event, getter = getter.result(), None
                yield {"event": event}
                if "end" in event:
                    return
                last_sent = time.monotonic()
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

    @staticmethod
    def _write_input(proc: Process, data: Any) -> None:
        """Write one ``ProcessInput`` (``{"stdin": b64}`` or ``{"pty": b64}``) to the process."""
        data = data if isinstance(data, dict) else {}
        kind = "pty" if proc.pty_master is not None else "stdin"
        if kind not in data or len(data) != 1:
            raise ConnectError("invalid_argument", f"this process accepts only '{kind}' input")
        if proc.stdin is None or proc.stdin.is_closing():
            raise ConnectError("failed_precondition", "stdin of the process is not open")
        proc.stdin.write(b64decode(data[kind]))

    async def rpc_send_input(self, msg: dict, ctx: CallContext) -> dict:
        self._write_input(self.find(msg.get("process")), msg.get("input"))
        return {}

    async def rpc_stream_input(self, messages: AsyncIterator[dict], ctx: CallContext) -> dict:
        """Client stream: ``start{process}`` first, then ``data{input}`` messages written in order
        (with back-pressure: a process that does not read stalls the stream, not our memory),
        ``keepalive`` anywhere. Answers ``{}`` once the client ends the stream."""
        proc: Process | None = None
        async for msg in messages:
            if "start" in msg:
                if proc is not None:
                    raise ConnectError("invalid_argument", "start may only be the first message")
                proc = self.find((msg.get("start") or {}).get("process"))
            elif "data" in msg:
                if proc is None:
                    raise ConnectError("invalid_argument", "the first message must be start")
                self._write_input(proc, (msg.get("data") or {}).get("input"))
                while (proc.stdin is not None and not proc.stdin.is_closing()
                       and proc.stdin.get_write_buffer_size() > STDIN_BUFFER):
                    await asyncio.sleep(0.005)
            elif "keepalive" not in msg:
                raise ConnectError("invalid_argument", f"unknown StreamInput message: {sorted(msg)}")
        if proc is None:
            raise ConnectError("invalid_argument", "the stream had no start message")
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
