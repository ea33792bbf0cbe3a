"""Running host commands from async code.

Every external command (qemu-img, ip, nft, mkfs) goes through ``run`` so that a failure becomes
one ``ExternalCommandError`` carrying the argv and the output, and nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass

from agentenv.errors import ExternalCommandError


async def run(argv: list[str], *, input: bytes | None = None, check: bool = True) -> str:
    """Run ``argv`` to completion and return its combined output.

    Raises ExternalCommandError when it exits non-zero and ``check`` is set. If the caller is
    cancelled, the command is killed and reaped first (a cancelled conversion must not leave
    ``umoci`` writing into a tree its caller is deleting).
    """
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = await proc.communicate(input)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    text = out.decode(errors="replace")
    if check and proc.returncode != 0:
        raise ExternalCommandError(argv, proc.returncode or -1, text)
    return text


def run_sync(argv: list[str], *, check: bool = True, cwd: str | None = None) -> str:
    """Blocking twin of ``run`` for provisioning (CLI only, never on the server's loop)."""
    res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd)
    text = res.stdout.decode(errors="replace")
    if check and res.returncode != 0:
        raise ExternalCommandError(argv, res.returncode, text)
    return text


@dataclass(frozen=True)
class Completed:
    """What a bounded command left behind: its exit code, stdout as bytes, stderr as text."""

    returncode: int
    stdout: bytes
    stderr: str


async def run_bounded(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Completed:
    """Run ``argv`` for at most ``timeout`` seconds, stdout and stderr kept apart.

    Never raises for a non-zero exit (the caller classifies the stderr: registry tools say
    *why* they failed there). On timeout, or if the caller is cancelled, the command's whole
    process group is killed and reaped before ``TimeoutError`` (or the cancellation) propagates,
    so nothing outlives the call.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return Completed(proc.returncode if proc.returncode is not None else -1, out, err.decode(errors="replace"))
