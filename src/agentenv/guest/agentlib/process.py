"""The ``process.Process`` service: spawning, output fan-out, reaping, stdin, signals.

Children are started by the tools drive's spawn library (agentlib/spawn.py: namespace, cwd,
user, terminal, one vfork+exec) and reaped by a single SIGCHLD handler calling ``waitpid(-1)``;
the agent is a child subreaper, so the same handler also reaps orphaned grandchildren. A process's output is
fanned out to its subscribers (the Start stream, later Connect streams) through bounded queues: a
slow client back-pressures the process instead of growing memory, and a client that goes away
merely unsubscribes -- the process keeps running.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import fcntl
import os
import pty
import signal
import struct
import termios
import time
from typing import Any, AsyncIterator, Callable

from .common import (
    DEFAULT_PATH,
    DISCONNECT_POLL,
    EXIT_GRACE,
    FINISHED_TTL,
    MAX_ARGS,
    OUTPUT_CHUNK,
    SIGNALS,
    CallContext,
    ConnectError,
    b64decode,
    fallback_shell,
    is_tool,
    log,
    on_path,
    spawner,
)
from .fsutil import chown_to
from .spawn import SpawnFailed

STDIN_BUFFER = 256 * 1024  # StreamInput waits while more than this is queued for the process
EXIT_DRAIN_MAX = 10.0  # after an exit, how long the end waits for a slow client to catch up
LEFT_IN_PIPE_MAX = 1 << 20  # what the end still takes from a paused output (a pipe holds 64 KiB)
MAX_FINISHED = 4096  # finished processes kept for a late Connect (besides FINISHED_TTL)



def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (field 6 of /proc/PID/stat, after the command name,
    which may hold spaces and parentheses)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            out.append(int(name))
    return out

class Subscriber:
    """One consumer (a Start or Connect stream) of a process's events, with a bounded queue."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict] = asyncio.Queue(maxsize=64)
        self.closed = False
        self.backlog = 0  # events waiting for room in the queue; later ones queue behind them

    async def put(self, event: dict) -> None:
        if not self.closed:
            await self.queue.put(event)

    def close(self) -> None:
        """Stop receiving; emptying the queue releases a producer blocked on a full queue."""
        self.closed = True
        while not self.queue.empty():
            self.queue.get_nowait()


class StdinFlow(asyncio.Protocol):
    """Flow control of a process's stdin pipe: the transport pauses writers while more than
    STDIN_BUFFER waits for the process and resumes them once it has read most of it."""

    def __init__(self) -> None:
        self._writable = asyncio.Event()
        self._writable.set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()  # nothing more will be taken: nobody waits for it

    async def writable(self) -> None:
        await self._writable.wait()


class Process:
    """A command started through the agent: its output descriptors, its subscribers and, later,
    its end event.

    Output is read with ``loop.add_reader`` callbacks straight from the descriptors, and the end
    is assembled from callbacks too (exit status from the reaper, EOF from the readers): no
    transports, stream readers or tasks per command. Under emulation each of those costs
    milliseconds, and a short command's round trip is mostly this bookkeeping. Stdin becomes an
    asyncio transport only when the first input arrives."""

    def __init__(self, pid: int, config: dict, tag: str | None, outputs: list[tuple[int, str]],
                 stdin_fd: int | None, pty_master: int | None) -> None:
        self.pid, self.config, self.tag = pid, config, tag
        self.pty_master = pty_master
        self.stdin: asyncio.WriteTransport | None = None
        self._stdin_fd = stdin_fd  # the raw write end, until input needs a transport
        self.subscribers: set[Subscriber] = set()
        self.end: dict | None = None
        self.finished_at = 0.0
        self.deadline_exceeded = False
        self._loop = asyncio.get_running_loop()
        self._outputs = outputs  # (fd, kind) of the outputs still open
        self._status: int | None = None
        self._on_finish: Callable[[Process], None] | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop only keeps weak ones
        self._paused: set[int] = set()  # outputs not read while a slow client catches up
        self._drain_until = 0.0
        self._stdin_ready: asyncio.Future[asyncio.WriteTransport] | None = None
        self._stdin_flow: StdinFlow | None = None  # made with the transport
        self._input_lock: asyncio.Lock | None = None  # one input at a time, made on first input

    def info(self) -> dict:
        info = {"config": self.config, "pid": self.pid}
        if self.tag:
            info["tag"] = self.tag
        return info

    def attach(self, timeout: float | None, on_finish: Callable[[Process], None]) -> None:
        """Start reading the outputs and, with ``timeout``, the deadline timer."""
        self._on_finish = on_finish
        for fd, kind in self._outputs:
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._readable, fd, kind)
        if timeout is not None:
            self._timers.append(self._loop.call_later(timeout, self._on_deadline))

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

    # ---- stdin -------------------------------------------------------------------------------

    @property
    def stdin_open(self) -> bool:
        if self.stdin is not None:
            return not self.stdin.is_closing()
        return self._stdin_fd is not None or self._stdin_ready is not None

    async def input(self) -> asyncio.WriteTransport:
        """The stdin (or PTY) transport, made on first use; check ``stdin_open`` first. Inputs
        that arrive while it is being made wait for the same one."""
        if self.stdin is not None:
            return self.stdin
        if self._stdin_ready is None:
            fd, self._stdin_fd = self._stdin_fd, None
            assert fd is not None
            self._stdin_ready = self._loop.create_future()
            try:
                flow = self._stdin_flow = StdinFlow()
                transport, _ = await self._loop.connect_write_pipe(lambda: flow, os.fdopen(fd, "wb", buffering=0))
                transport.set_write_buffer_limits(high=STDIN_BUFFER)
            except BaseException as exc:
                self._stdin_ready.set_exception(ConnectError("failed_precondition", f"stdin: {exc}"))
                self._stdin_ready.exception()  # retrieved: nobody else may be waiting
                raise
            self.stdin = transport
            self._stdin_ready.set_result(transport)
            return transport
        return await asyncio.shield(self._stdin_ready)

    async def write_input(self, data: bytes) -> None:
        """Write ``data`` to stdin and return once at most STDIN_BUFFER of it waits for the
        process (back-pressure: input to a process that does not read stays with the caller,
        not in our memory). Callers take turns, so concurrent or retried calls wait before
        they write and the buffer holds at most one call's data beyond the limit."""
        if self._input_lock is None:
            self._input_lock = asyncio.Lock()
        async with self._input_lock:
            stdin = await self.input()
            if stdin.is_closing():  # closed (CloseStdin, the end) while this input waited its turn
                raise ConnectError("failed_precondition", "stdin of the process is not open")
            stdin.write(data)
            assert self._stdin_flow is not None
            await self._stdin_flow.writable()

    def close_stdin(self) -> None:
        if self.stdin is not None:
            self.stdin.close()
        elif self._stdin_fd is not None:
            os.close(self._stdin_fd)
            self._stdin_fd = None
        elif self._stdin_ready is not None and not self._stdin_ready.done():  # being made: close it then
            self._stdin_ready.add_done_callback(
                lambda f: f.result().close() if not f.cancelled() and f.exception() is None else None)

    def resize(self, cols: int, rows: int) -> None:
        if self.pty_master is None or self.end is not None or not any(fd == self.pty_master for fd, _ in self._outputs):
            raise ConnectError("failed_precondition", "the process has no PTY")
        set_winsize(self.pty_master, cols, rows)

    # ---- signals and the end -----------------------------------------------------------------

    def signal(self, signum: int) -> None:
        """Signal the command's whole session (each command is a session of its own), so
        `bash -c 'a; b'` and anything it started goes down with it: its process group, and the
        groups that moved out of it (GNU `timeout`, a PTY shell's jobs, `setpgid`). Only what
        left the session on purpose (`setsid`, a daemon) is left alone."""
        try:
            os.killpg(self.pid, signum)
        except OSError:
            try:
                os.kill(self.pid, signum)
            except OSError:
                pass
        for member in session_members(self.pid):
            try:
                os.kill(member, signum)
            except OSError:
                pass

    def on_exit(self, status: int) -> None:
        """Called by the SIGCHLD reaper. The end is sent once the outputs are closed too; they
        normally close together with the process, but a background grandchild may hold them
        open forever, so not for longer than EXIT_GRACE."""
        if self._status is not None:
            return
        self._status = status
        if self._outputs:
            self._drain_until = time.monotonic() + EXIT_DRAIN_MAX
            self._timers.append(self._loop.call_later(EXIT_GRACE, self._grace_over))
        else:
            self._complete()

    def _grace_over(self) -> None:
        """EXIT_GRACE after the exit with outputs still open: end now, unless reading them is
        paused for a slow client; then what the process wrote before it exited is still in the
        pipe, and the grace counts again once the client has caught up -- for at most
        EXIT_DRAIN_MAX: a background grandchild may keep the pipe full forever, and a client
        may stop reading without going away."""
        if self._paused and time.monotonic() < self._drain_until:
            self._timers.append(self._loop.call_later(EXIT_GRACE, self._grace_over))
        else:
            self._complete()

    def _on_deadline(self) -> None:
        log(f"process {self.pid} exceeded its timeout, killing it")
        self.deadline_exceeded = True
        self.signal(signal.SIGKILL)

    def _readable(self, fd: int, kind: str) -> None:
        """Forward one read (<= 32 KiB) to the subscribers; after the end, keep draining (to
        nobody) so a lingering background grandchild never blocks on a full pipe."""
        try:
            data = os.read(fd, OUTPUT_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO on a PTY master once the last slave fd is closed
            data = b""
        if not data:
            self._loop.remove_reader(fd)
            os.close(fd)
            self._outputs = [(f, k) for f, k in self._outputs if f != fd]  # the number may be reused
            if not self._outputs and self._status is None:
                self._reap_now()
            if not self._outputs and self._status is not None:
                self._complete()
            return
        if self.end is None and self.subscribers:
            full = self._deliver({"data": {kind: base64.b64encode(data).decode()}})
            if full:  # a slow client: stop reading until it has room (back-pressure)
                self._loop.remove_reader(fd)
                self._paused.add(fd)
                self._spawn_task(self._deliver_later(full, fd, kind))

    def _reap_now(self) -> None:
        """The outputs closed, most often because the process exited: collect it now rather
        than in the SIGCHLD handler's turn of the event loop (milliseconds later under
        emulation). A process still running (it closed its outputs itself) is left to it."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by the handler meanwhile
            return
        if pid == self.pid:
            self._status = status

    def _deliver(self, event: dict) -> list[tuple[Subscriber, dict]]:
        """Queue ``event`` for every subscriber with room; return the ones without."""
        full = []
        for sub in self.subscribers:
            if sub.closed:
                continue
            if sub.backlog or sub.queue.full():
                sub.backlog += 1
                full.append((sub, event))
            else:
                sub.queue.put_nowait(event)
        return full

    async def _deliver_later(self, pending: list[tuple[Subscriber, dict]], fd: int | None = None,
                             kind: str = "") -> None:
        for sub, event in pending:
            await sub.put(event)
            sub.backlog -= 1
        if fd is not None:
            self._paused.discard(fd)
            self._loop.add_reader(fd, self._readable, fd, kind)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _complete(self) -> None:
        if self.end is not None or self._status is None:
            return
        for timer in self._timers:
            timer.cancel()
        status = self._status
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
        full = self._left_in_paused_outputs()
        full += self._deliver({"end": end})
        self.end, self.finished_at = end, time.monotonic()
        self.subscribers.clear()
        self.close_stdin()
        if full:  # its subscribers get the end once they have room; it no longer runs now
            self._spawn_task(self._deliver_later(full))
        self._finished()

    def _left_in_paused_outputs(self) -> list[tuple[Subscriber, dict]]:
        """The end comes while reading an output is paused for a slow client (it gave up
        waiting for it: EXIT_DRAIN_MAX): what the process left in that pipe goes before the
        end, not dropped (a test run's summary is its last lines). Read without blocking,
        to EOF or to LEFT_IN_PIPE_MAX (a background grandchild may keep writing)."""
        full: list[tuple[Subscriber, dict]] = []
        kinds = dict(self._outputs)
        for fd in sorted(self._paused):
            left = LEFT_IN_PIPE_MAX
            while left > 0:
                try:
                    data = os.read(fd, min(OUTPUT_CHUNK, left))
                except OSError:  # BlockingIOError: nothing more now; EIO: a PTY whose slave closed
                    break
                if not data:
                    break
                left -= len(data)
                full += self._deliver({"data": {kinds.get(fd, "stdout"): base64.b64encode(data).decode()}})
        return full

    def _finished(self) -> None:
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish(self)


class Stdio:
    """The descriptors of a new process: a pty, or pipes for stdout and stderr and, unless the
    caller said ``stdin: false``, for stdin (else /dev/null). ``child`` are the ends the process
    gets as 0, 1, 2; the agent keeps ``outputs``, ``stdin`` and ``master``."""

    def __init__(self, pty_size: tuple[int, int] | None, want_stdin: bool, user: Any) -> None:
        self._child_ends: list[int] = []
        self._own: list[int] = []
        self.master: int | None = None
        self.stdin: int | None = None
        try:
            if pty_size is not None:
                self.master, slave = pty.openpty()
                self._own.append(self.master)
                self._child_ends.append(slave)
                set_winsize(self.master, *pty_size)
                chown_to(slave, user)
                self.stdin = os.dup(self.master)
                self._own.append(self.stdin)
                self.child = (slave, slave, slave)
                self.outputs = [(self.master, "pty")]
                return
            if want_stdin:
                stdin_r, self.stdin = os.pipe()
                self._own.append(self.stdin)
            else:
                stdin_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            self._child_ends.append(stdin_r)
            out_r, out_w = os.pipe()
            self._own.append(out_r)
            self._child_ends.append(out_w)
            err_r, err_w = os.pipe()
            self._own.append(err_r)
            self._child_ends.append(err_w)
            self.child = (stdin_r, out_w, err_w)
            self.outputs = [(out_r, "stdout"), (err_r, "stderr")]
        except BaseException:
            self.close_all()
            raise

    def file_actions(self) -> list[tuple]:
        return [(os.POSIX_SPAWN_DUP2, fd, n) for n, fd in enumerate(self.child)]

    def close_child_ends(self) -> None:
        for fd in self._child_ends:
            os.close(fd)
        self._child_ends = []

    def close_all(self) -> None:
        self.close_child_ends()
        for fd in self._own:
            os.close(fd)
        self._own = []


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
        """Move ``proc`` to the finished ones and forget those past FINISHED_TTL. ``finished``
        is in the order processes finished (a dict keeps insertion order), so the expired ones
        are at its front: each finish costs O(1), not a scan of every command of the last
        minutes (a rollout runs thousands, and the scan made every command slower as they piled up)."""
        if self.running.get(proc.pid) is proc:  # (its pid may be another process's by now)
            del self.running[proc.pid]
        self.finished.pop(proc.pid, None)  # a reused pid goes to the back
        self.finished[proc.pid] = proc
        proc.config = {}  # (a late Connect needs its end, not its command, which may be large)
        cutoff = time.monotonic() - FINISHED_TTL
        while self.finished and ((oldest := next(iter(self.finished.values()))).finished_at < cutoff
                                 or len(self.finished) > MAX_FINISHED):
            del self.finished[oldest.pid]

    def find(self, selector: Any, finished_ok: bool = False) -> Process:
        selector = selector if isinstance(selector, dict) else {}
        pid, tag = selector.get("pid"), selector.get("tag")
        key = int(pid) if isinstance(pid, (int, str)) and str(pid).isdigit() else None
        proc = self.running.get(key) or (self.finished.get(key) if finished_ok else None)
        if proc is not None:
            return proc
        if tag:  # a running one, else the one that finished last
            for proc in [*self.running.values(), *(reversed(self.finished.values()) if finished_ok else ())]:
                if proc.tag == tag:
                    return proc
        raise ConnectError("not_found", f"process with {'pid ' + str(pid) if pid else 'tag ' + str(tag)} not found")

    async def spawn(self, msg: dict, ctx: CallContext) -> tuple[Process, Subscriber]:
        """Start a process; the returned subscriber is attached before any output is read."""
        cfg = msg.get("process") or {}
        cmd, raw_args, envs = cfg.get("cmd"), cfg.get("args") or [], cfg.get("envs") or {}
        if not cmd or not isinstance(cmd, str) or not isinstance(envs, dict):
            raise ConnectError("invalid_argument", "process.cmd is required")
        if not isinstance(raw_args, list):
            raise ConnectError("invalid_argument", "process.args must be a list of strings")
        if len(raw_args) + len(envs) > MAX_ARGS:  # before a Python string is made of each
            raise ConnectError("invalid_argument", f"more than {MAX_ARGS} args and env vars: the kernel "
                                                   "cannot start such a command")
        args = [str(a) for a in raw_args]
        try:  # what the kernel cannot take (a lone surrogate from JSON's \ud800, a NUL) fails here, not mid-spawn
            for s in (cmd, *args, *map(str, envs), *map(str, envs.values())):
                if "\0" in s:
                    raise ConnectError("invalid_argument", "process cmd, args and envs cannot contain NUL")
                os.fsencode(s)
        except UnicodeError:
            raise ConnectError("invalid_argument", "process cmd, args and envs must be valid Unicode text") from None
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
        cmd = fallback_shell(cmd, env["PATH"]) or cmd
        pty_cfg = msg.get("pty")
        switch = (user.uid, user.gid, set(user.groups)) != (os.geteuid(), os.getegid(), set(os.getgroups()))
        if switch and os.geteuid() != 0:
            raise ConnectError("permission_denied", "the agent is not root and cannot switch users")
        if "/" not in cmd and not on_path(cmd, env["PATH"]):
            raise ConnectError("invalid_argument", f"error starting process '{cmd}': no such executable")
        pty_size = None
        if isinstance(pty_cfg, dict):
            size = pty_cfg.get("size") or {}
            pty_size = pty_dimensions(size)
        stdio = Stdio(pty_size, msg.get("stdin") is not False, user)
        try:
            # One vfork+exec with no Python in between (guest/spawn.c): it enters PID 1's mount
            # namespace (the image without the tools drive), the cwd, the user and the terminal.
            pid = spawner().spawn(
                cmd, args, env, cwd=cwd, stdio=stdio.child, ctty=pty_size is not None,
                user=(user.uid, user.gid, user.groups) if switch else None,
                preopen=is_tool(cmd))  # a tools-drive program (fallback shell): not in the user's view
        except OSError as exc:
            stdio.close_all()
            why = f"{exc.step}: {exc.strerror}" if isinstance(exc, SpawnFailed) else str(exc)
            raise ConnectError(start_error_code(exc), f"error starting process '{cmd}': {why}") from None
        except BaseException:
            stdio.close_all()
            raise
        stdio.close_child_ends()
        config = {k: v for k, v in (("cmd", cmd), ("args", args), ("envs", envs),
                                      ("cwd", cfg.get("cwd"))) if v}
        proc = Process(pid, config, msg.get("tag") or None, stdio.outputs, stdio.stdin, stdio.master)
        self.running[proc.pid] = proc
        self.finished.pop(proc.pid, None)
        sub = proc.subscribe()
        proc.attach(ctx.timeout, self._finish)
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
        try:  # a client gone at the first event closes us there: its queue must not stay subscribed
            yield {"event": {"start": {"pid": proc.pid}}}
            async for event in self.follow(proc, sub, ctx, None):
                yield event
        finally:
            proc.unsubscribe(sub)
        if proc.deadline_exceeded:
            raise ConnectError("deadline_exceeded", "process killed: timeout (Connect-Timeout-Ms) elapsed")

    async def rpc_connect(self, msg: dict, ctx: CallContext) -> AsyncIterator[dict]:
        proc = self.find(msg.get("process"), finished_ok=True)
        sub = proc.subscribe()
        deadline = time.monotonic() + ctx.timeout if ctx.timeout is not None else None
        try:
            yield {"event": {"start": {"pid": proc.pid}}}
            async for event in self.follow(proc, sub, ctx, deadline):
                yield event
        finally:
            proc.unsubscribe(sub)

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
    async def _write_input(proc: Process, data: Any) -> None:
        """Write one ``ProcessInput`` (``{"stdin": b64}`` or ``{"pty": b64}``) to the process."""
        data = data if isinstance(data, dict) else {}
        kind = "pty" if proc.pty_master is not None else "stdin"
        if kind not in data or len(data) != 1:
            raise ConnectError("invalid_argument", f"this process accepts only '{kind}' input")
        if not proc.stdin_open:
            raise ConnectError("failed_precondition", "stdin of the process is not open")
        await proc.write_input(b64decode(data[kind]))

    async def rpc_send_input(self, msg: dict, ctx: CallContext) -> dict:
        await self._write_input(self.find(msg.get("process")), msg.get("input"))
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
                await self._write_input(proc, (msg.get("data") or {}).get("input"))
            elif "keepalive" not in msg:
                raise ConnectError("invalid_argument", f"unknown StreamInput message: {sorted(msg)}")
        if proc is None:
            raise ConnectError("invalid_argument", "the stream had no start message")
        return {}

    async def rpc_close_stdin(self, msg: dict, ctx: CallContext) -> dict:
        proc = self.find(msg.get("process"))
        if proc.pty_master is not None:
            raise ConnectError("failed_precondition", "cannot close stdin of a PTY process")
        proc.close_stdin()
        return {}

    async def rpc_update(self, msg: dict, ctx: CallContext) -> dict:
        proc = self.find(msg.get("process"))
        size = (msg.get("pty") or {}).get("size")
        if size:
            proc.resize(*pty_dimensions(size))
        return {}


# Start failures a retry may get past (process, descriptor, memory or terminal limits): the
# code clients' retry policies key on, as envd answers. Any other is the request's fault.
RETRYABLE_START_ERRORS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})


def start_error_code(exc: OSError) -> str:
    """A command the child could not exec is the request's fault; a process that could not be
    made at all is the agent's (its spawn library, its namespace descriptor), unless a limit."""
    if exc.errno in RETRYABLE_START_ERRORS:
        return "resource_exhausted"
    return "invalid_argument" if isinstance(exc, SpawnFailed) else "internal"


def pty_dimensions(size: Any) -> tuple[int, int]:
    """(cols, rows) of a PTY size message; each must fit the kernel's 16 bits."""
    if not isinstance(size, dict):
        raise ConnectError("invalid_argument", "pty.size must be an object with cols and rows")
    out = []
    for key, default in (("cols", 80), ("rows", 24)):
        value = size.get(key, default)
        if isinstance(value, str) and value.isdigit():  # protobuf's JSON allows numbers as strings
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFF:
            raise ConnectError("invalid_argument", f"pty.size.{key} must be an integer from 0 to 65535")
        out.append(value)
    return out[0], out[1]


def set_winsize(fd: int, cols: int, rows: int) -> None:
    """Resize a PTY; the kernel then sends SIGWINCH to its foreground process group."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))
