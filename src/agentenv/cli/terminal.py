"""The shell of `aenv start` and `aenv connect`: a process in the sandbox, driven over envd.

The CLI talks to the sandbox's envd through the server's sandbox proxy (same address as the
API; requests carry ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port: 49983`` and envd's
``X-Access-Token``), with the Connect protocol of :class:`agentenv.envd_client.EnvdClient`.

Two modes, chosen by whether stdin is a terminal:

* **terminal**: ``/bin/bash -i -l`` on a PTY the size of the local terminal. The local terminal
  is put in raw mode, so every key (Ctrl-C as the byte 0x03, Ctrl-D, arrows, …) goes to the
  remote PTY over one client-streaming ``process.Process/StreamInput`` call; PTY output is
  written to stdout as it comes; SIGWINCH is forwarded as ``process.Process/Update``. The
  terminal settings are restored on every way out.
* **pipe** (scripts, tests): ``/bin/bash -l`` without a PTY reads stdin as its script, so
  ``echo 'cd /tmp; pwd; exit 3' | aenv start`` prints ``/tmp`` and exits 3. stdout and stderr
  stay separate and carry no prompt or echo.

Either way the command's exit code is the shell's. While the shell runs, the sandbox is
refreshed every minute (``POST /sandboxes/{id}/refreshes``, which never shortens a timeout), so
it is not killed under a user who is still typing.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, suppress
from typing import Any

from agentenv.cli.context import CliError, CommandNotStarted, CommandTimedOut
from agentenv.cli.exitstatus import exit_status, signal_number
from agentenv.envd_client import EnvdClient, EnvdError, EnvdUnavailable

ENVD_PORT = 49983
REFRESH_EVERY_S = 60.0
# Input chunks read ahead of the sandbox: a fast producer waits instead of filling our memory.
INPUT_AHEAD = 16


def envd_for(server_url: str, sandbox: dict[str, Any]) -> EnvdClient:
    """An envd client for ``sandbox`` (its create/connect/get JSON) via the server's proxy."""
    host = server_url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    return EnvdClient(server_url, sandbox.get("envdAccessToken"), timeout=30.0,
                      headers={"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": str(ENVD_PORT)},
                      trust_env=host not in ("127.0.0.1", "localhost", "::1"))


def run_shell(server_url: str, sandbox: dict[str, Any], refresh: Callable[[], object] | None = None) -> int:
    """Run a shell in the sandbox until it exits; returns its exit code. ``refresh`` (a blocking
    call, run in a thread) is called every REFRESH_EVERY_S seconds meanwhile; its errors are ignored."""
    fd = _stdin_fd()
    session = _terminal_session if fd is not None and os.isatty(fd) else _pipe_session
    try:
        return asyncio.run(_until_signalled(session(envd_for(server_url, sandbox)), refresh))
    except EnvdError as exc:
        raise CliError(f"shell in sandbox {sandbox['sandboxID']}: {exc.message or exc.code}") from None


def run_piped(server_url: str, sandbox: dict[str, Any], cmd: str | list[str], *,
              envs: dict[str, str] | None = None, cwd: str | None = None, user: str | None = None,
              timeout: float = 0) -> int:
    """Run ``cmd`` (a ``bash -l -c`` string or an argv list) with the local stdin as its
    stdin (`aenv exec -i`); returns its exit code."""
    session = _pipe_session(envd_for(server_url, sandbox), cmd, envs=envs, cwd=cwd, user=user, timeout=timeout)
    try:
        return asyncio.run(_until_signalled(session))
    except EnvdError as exc:
        if exc.code == "deadline_exceeded":
            raise CommandTimedOut(f"the command ran longer than its timeout ({timeout:g} s) and was killed") from None
        if exc.code == "invalid_argument":
            raise CommandNotStarted(exc.message) from None
        raise CliError(f"command in sandbox {sandbox['sandboxID']}: {exc.message or exc.code}") from None


def _stdin_fd() -> int | None:
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _exit_code(exit_code: int, exited: bool, status: str) -> int:
    """As `aenv exec` reports it: the code, or 128+N (and a line on stderr) for signal N."""
    if exited or exit_code >= 0:
        return exit_status(exit_code, status)
    _write(sys.stderr.buffer, f"aenv: {status}\n".encode())
    num = signal_number(status)
    return 128 + (num if num is not None else signal.SIGKILL)


async def _refresh_loop(refresh: Callable[[], object]) -> None:
    """At once, then every ``REFRESH_EVERY_S``: a sandbox with less than that to live
    (`aenv start --timeout 30`) would die under the attached shell before the first refresh."""
    while True:
        with suppress(Exception):
            await asyncio.to_thread(refresh)
        await asyncio.sleep(REFRESH_EVERY_S)


async def _until_signalled(session: Any, refresh: Callable[[], object] | None = None) -> int:
    """Run ``session``; SIGTERM or SIGHUP to aenv cancels it (so its cleanup runs) and gives 128+N."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(session)
    refresher = asyncio.ensure_future(_refresh_loop(refresh)) if refresh else None
    got: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, lambda n=signum: (got.append(n), task.cancel()))
    try:
        return await task
    except asyncio.CancelledError:
        if got:
            return 128 + got[0]
        raise
    finally:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        if refresher is not None:
            refresher.cancel()
            with suppress(asyncio.CancelledError):
                await refresher


async def _queue_chunks(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (chunk := await queue.get()) is not None:
        yield chunk


def _read_into(queue: asyncio.Queue[bytes | None], loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
    """Thread body: copy stdin into ``queue`` until EOF, then None (an unreadable stdin, e.g. a
    hung-up terminal, ends the input too). A daemon thread, as a blocked read can't be
    interrupted; it works for pipes and regular files alike. It reads the file descriptor, not
    ``sys.stdin.buffer``: a daemon thread blocked holding that buffer's lock makes the
    interpreter abort at exit (Ctrl-C while the input is still open)."""
    fd = _stdin_fd()
    while fd is not None and not stop.is_set():
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:  # a non-blocking stdin: wait until it has data
            select.select([fd], [], [], 0.5)
            continue
        except (OSError, ValueError):
            break
        if not chunk or not _put(queue, loop, chunk, stop):
            break
    _put(queue, loop, None, stop)


def _put(queue: asyncio.Queue[bytes | None], loop: asyncio.AbstractEventLoop, item: bytes | None,
         stop: threading.Event) -> bool:
    """Put ``item`` from a thread, waiting while the queue is full; False once aenv is going."""
    try:
        done = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
    except RuntimeError:  # the loop is closed
        return False
    while not stop.is_set():
        try:
            done.result(0.5)
            return True
        except TimeoutError:
            continue
        except BaseException:  # noqa: BLE001 — cancelled with the loop
            return False
    done.cancel()
    return False


def _write(stream: Any, data: bytes) -> None:
    stream.write(data)
    stream.flush()


async def _pipe_session(envd: EnvdClient, cmd: str | list[str] | None = None, *,
                        envs: dict[str, str] | None = None, cwd: str | None = None,
                        user: str | None = None, timeout: float | None = None) -> int:
    """``cmd`` (default: ``bash -l``, which reads stdin as its script) with the local stdin
    streamed to it until EOF, then closed; stdout/stderr relayed as they are. If aenv goes
    before the process ends, the process is killed, as a local pipeline's would be."""
    async with envd:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(INPUT_AHEAD)
        stop = threading.Event()
        feeder: asyncio.Task[None] | None = None
        pid = 0
        input_cut: list[EnvdError] = []

        async def feed(pid: int) -> None:
            try:
                await envd.stream_input(pid, _queue_chunks(queue))
                await envd.close_stdin(pid)
            except EnvdUnavailable as exc:
                # The input's connection was cut while the process may still be reading: it
                # must not go on with part of its input (a `tar x` would leave half a tree).
                input_cut.append(exc)
                with suppress(EnvdError):
                    await envd.send_signal(pid, "SIGKILL")
            except EnvdError:
                pass  # the process ended before reading all of stdin (e.g. `exit` in the middle)

        if cmd is None:
            cmd, envs = ["/bin/bash", "-l"], {**_term_env(dumb=True), **(envs or {})}
        events = envd.stream(cmd, stdin=True, envs=envs, cwd=cwd, user=user, timeout=timeout or None)
        try:
            async with aclosing(events):
                async for ev in events:
                    if ev.type == "start":
                        pid = ev.pid
                        threading.Thread(target=_read_into, args=(queue, loop, stop), daemon=True).start()
                        feeder = asyncio.create_task(feed(ev.pid))
                    elif ev.type in ("stdout", "pty"):
                        _write(sys.stdout.buffer, ev.data)
                    elif ev.type == "stderr":
                        _write(sys.stderr.buffer, ev.data)
                    elif ev.type == "end":
                        pid = 0
                        if input_cut:  # (recorded before the kill that ended it)
                            raise EnvdError("unavailable", f"its input was cut ({input_cut[0].message}); "
                                                           "the command was killed")
                        return _exit_code(ev.exit_code, ev.exited, ev.status)
        finally:
            stop.set()
            if feeder is not None:
                feeder.cancel()
                with suppress(asyncio.CancelledError, EnvdError):
                    await feeder
            if pid:
                with suppress(EnvdError, asyncio.TimeoutError):
                    await asyncio.wait_for(envd.send_signal(pid, "SIGKILL"), 10)
        raise EnvdError("internal", "the process's output stream ended without an exit status")


def _term_env(dumb: bool = False) -> dict[str, str]:
    env = {"TERM": "dumb" if dumb else os.environ.get("TERM") or "xterm-256color"}
    if lang := os.environ.get("LANG"):
        env["LANG"] = lang
    return env


def _size() -> tuple[int, int]:
    cols, rows = shutil.get_terminal_size((80, 24))
    try:
        cols, rows = os.get_terminal_size(sys.stdin.fileno())
    except OSError:
        pass
    return cols, rows


async def _terminal_session(envd: EnvdClient) -> int:
    """``bash -i -l`` on a remote PTY; the local terminal in raw mode, relayed both ways."""
    fd = sys.stdin.fileno()
    out = sys.stdout.buffer
    loop = asyncio.get_running_loop()
    saved = termios.tcgetattr(fd)
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    tasks: set[asyncio.Task[Any]] = set()
    pid = 0

    def on_key() -> None:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if data:
            queue.put_nowait(data)
        else:  # the terminal hung up
            loop.remove_reader(fd)
            if pid:
                tasks.add(asyncio.ensure_future(envd.send_signal(pid, "SIGKILL")))

    def on_resize() -> None:
        if pid:
            cols, rows = _size()
            task = asyncio.ensure_future(envd.resize_pty(pid, cols, rows))
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), t.cancelled() or t.exception()))

    async def feed() -> None:
        try:
            await envd.stream_input(pid, _queue_chunks(queue), pty=True)
        except EnvdError:
            # StreamInput unavailable or cut: type the remaining keys one call at a time.
            while (chunk := await queue.get()) is not None:
                with suppress(EnvdError):
                    await envd.send_pty(pid, chunk)

    async with envd:
        events = envd.stream(["/bin/bash", "-i", "-l"], pty=_size(), envs=_term_env())
        try:
            tty.setraw(fd, termios.TCSANOW)
            async with aclosing(events):
                async for ev in events:
                    if ev.type == "start":
                        pid = ev.pid
                        loop.add_reader(fd, on_key)
                        loop.add_signal_handler(signal.SIGWINCH, on_resize)
                        tasks.add(asyncio.create_task(feed()))
                        on_resize()  # the window may have changed while the shell started
                    elif ev.type in ("pty", "stdout", "stderr"):
                        _write(out, ev.data)
                    elif ev.type == "end":
                        pid = 0  # ended: nothing to clean up in the sandbox
                        return _exit_code(ev.exit_code, ev.exited, ev.status)
        finally:
            loop.remove_reader(fd)
            loop.remove_signal_handler(signal.SIGWINCH)
            with suppress(termios.error, OSError):  # a hung-up terminal (its window closed): EIO
                termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            for task in list(tasks):
                task.cancel()
            for task in list(tasks):
                with suppress(asyncio.CancelledError, Exception):
                    await task
            if pid:  # aenv is going (SIGHUP: its window closed; SIGTERM; an error) before the
                # shell ended: the shell goes too, as a local one does with its terminal, not
                # left running in the sandbox with its jobs
                with suppress(EnvdError, asyncio.TimeoutError):
                    await asyncio.wait_for(envd.send_signal(pid, "SIGKILL"), 10)
        raise EnvdError("internal", "the shell's output stream ended without an exit status")
