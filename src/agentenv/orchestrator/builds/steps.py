"""The steps of a build, in its sandbox through the guest agent: RUN, COPY, the workdir,
the start command (tag "start") and the ready command. A mixin of ``Builds``
(runner.py), which provides ``orch``, ``_log`` and ``upload_path``."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.envd_client import EnvdError
from agentenv.orchestrator.builds.records import BuildRecord
from agentenv.orchestrator.builds.spec import BuildSpec, Config, Step

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

TAIL_LINES = 20
MAX_LOG_LINE = 16 * 1024  # a longer output line is logged in pieces
READY_INTERVAL_S = 0.5

# COPY in the guest, as root: unpack the upload, copy like Docker's COPY (a directory's
# contents into dest; one file to dest, or into it when dest ends with / or is a directory;
# a glob's matches into dest), then chown/chmod what was copied.
COPY_SCRIPT = r"""
set -eu
tarball=$1; src=$2; dest=$3; owner=$4; mode=$5; wd=$6
if [ -z "$owner" ]; then if id user >/dev/null 2>&1; then owner=user; else owner=root; fi; fi
case "$owner" in *:*) ;; *) owner="$owner:";; esac
u=${owner%%:*}
if [ -z "$wd" ]; then wd=$(getent passwd "$u" | cut -d: -f6); wd=${wd:-/}; fi
case "$dest" in /*) ;; *) dest="$wd/$dest";; esac
tmp=$(mktemp -d /tmp/.aenv-copy.XXXXXX)
trap 'rm -rf "$tmp" "$tarball"' EXIT
tar -xf "$tarball" -C "$tmp" --no-same-owner
src=${src#./}
while [ "${src%/}" != "$src" ]; do src=${src%/}; done
[ -n "$src" ] || src=.
fix() { chown -R "$owner" "$1"; if [ -n "$mode" ]; then chmod -R "$mode" "$1"; fi; }
mkdest() { if [ ! -d "$1" ]; then mkdir -p "$1"; chown "$owner" "$1"; fi; }
n=0
if [ -d "$tmp/$src" ]; then
  mkdest "$dest"
  for f in "$tmp/$src"/* "$tmp/$src"/.[!.]* "$tmp/$src"/..?*; do
    [ -e "$f" ] || [ -L "$f" ] || continue
    cp -a "$f" "$dest/"; fix "$dest/$(basename "$f")"; n=$((n+1))
  done
elif [ -e "$tmp/$src" ] || [ -L "$tmp/$src" ]; then
  case "$dest" in
    */) mkdest "$dest"; target="$dest$(basename "$src")";;
    *) if [ -d "$dest" ]; then target="$dest/$(basename "$src")"; else mkdir -p "$(dirname "$dest")"; target="$dest"; fi;;
  esac
  cp -a "$tmp/$src" "$target"; fix "$target"; n=1
else
  mkdest "$dest"
  cd "$tmp"
  for f in $src; do
    [ -e "$f" ] || [ -L "$f" ] || continue
    cp -a "$f" "$dest/"; fix "$dest/$(basename "$f")"; n=$((n+1))
  done
fi
[ "$n" -gt 0 ] || { echo "nothing in the uploaded files matches '$2'" >&2; exit 1; }
echo "copied $n item(s) to $dest"
"""

WORKDIR_SCRIPT = r"""
d=$1; owner=$2
if [ -z "$owner" ]; then if id user >/dev/null 2>&1; then owner=user; else owner=root; fi; fi
case "$owner" in *:*) ;; *) owner="$owner:";; esac
[ -d "$d" ] || { mkdir -p "$d" && chown "$owner" "$d"; }
"""


class StepFailed(Exception):
    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


def _lines(buf: bytearray, data: bytes) -> list[str]:
    """The log lines ``data`` completes; ``buf`` holds an unfinished one. A line longer than
    MAX_LOG_LINE is logged in pieces of that length: a step that writes without newlines
    (``cat /dev/urandom | base64 -w0``) must hold neither the server's memory nor, rescanned
    on every chunk, its event loop."""
    out = []
    *done, rest = data.split(b"\n")
    for part in done:
        buf += part
        out += _pieces(buf, final=True)
    buf += rest
    out += _pieces(buf, final=False)
    return out


def _pieces(buf: bytearray, *, final: bool) -> list[str]:
    """The whole MAX_LOG_LINE pieces of ``buf`` (taken out of it) and, when its line ended
    (``final``), the rest: an empty line too, unless the pieces were the whole of it."""
    out = []
    while len(buf) >= MAX_LOG_LINE:
        out.append(bytes(buf[:MAX_LOG_LINE]).decode(errors="replace").rstrip("\r"))
        del buf[:MAX_LOG_LINE]
    if final and (buf or not out):
        out.append(bytes(buf).decode(errors="replace").rstrip("\r"))
        buf.clear()
    return out


async def run_streamed(envd: Any, argv: list[str], on_output: Any, **kw: Any) -> int:
    """A command's exit code, its output only passed to ``on_output(data)``: none is kept (a
    build step may write gigabytes)."""
    code: int | None = None
    async with aclosing(envd.stream(argv, **kw)) as events:
        async for event in events:  # to the stream's end: a deadline is an error after the end event
            if event.type in ("stdout", "stderr"):
                on_output(event.type, event.data)
            elif event.type == "end":
                code = int(event.exit_code)
    if code is None:
        raise EnvdError("internal", "process stream ended without an end event")
    return code



class GuestSteps:
    orch: Orchestrator

    def _log(self, b: BuildRecord, message: str, *, level: str = "info", step: str | None = None) -> None:
        raise NotImplementedError

    def upload_path(self, files_hash: str) -> Path:
        raise NotImplementedError

    async def _shell(self, sid: str) -> str:
        res = await self.orch.exec(sid, ["/bin/sh", "-c", "command -v bash"], user="root", timeout=30)
        return "bash" if res.exit_code == 0 else "sh"

    @staticmethod
    def _argv(shell: str, cmd: str) -> list[str]:
        return ["/bin/bash", "-l", "-c", cmd] if shell == "bash" else ["/bin/sh", "-c", cmd]

    async def _run_logged(self, b: BuildRecord, sid: str, argv: list[str], *, step: str, cfg: Config,
                          user: str | None, tail: deque[str], timeout: float | None = None) -> int:
        """Run a command, its output lines appended to the build's log (and ``tail``)."""
        bufs = {"stdout": bytearray(), "stderr": bytearray()}

        def sink(which: str, data: bytes) -> None:
            for line in _lines(bufs[which], data):
                tail.append(line)
                self._log(b, line, step=step)

        code = await run_streamed(self.orch.envd(sid), argv, sink, envs=cfg.env, cwd=cfg.workdir, user=user,
                                  timeout=timeout)
        for buf in bufs.values():
            for line in _pieces(buf, final=True) if buf else ():
                tail.append(line)
                self._log(b, line, step=step)
        return code

    async def _ensure_workdir(self, sid: str, cfg: Config, ensured: set[str]) -> None:
        if cfg.workdir and cfg.workdir not in ensured:
            await self.orch.exec(sid, ["/bin/sh", "-c", WORKDIR_SCRIPT, "workdir", cfg.workdir, cfg.user or ""],
                                 user="root", timeout=60)
            ensured.add(cfg.workdir)

    async def _step(self, b: BuildRecord, sid: str, i: int, step: Step, cfg: Config, shell: str,
                    ensured: set[str]) -> None:
        name = str(i + 1)
        what = f"step {i + 1} ({step.describe()})"
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        try:
            if step.type == "RUN":
                await self._ensure_workdir(sid, cfg, ensured)
                user = step.args[1] if len(step.args) > 1 else cfg.user
                bound = self.orch.settings.build_step_timeout_s
                try:
                    code = await self._run_logged(b, sid, self._argv(shell, step.args[0]), step=name, cfg=cfg,
                                                  user=user, tail=tail, timeout=bound)
                    why = f"failed with exit code {code}" if code != 0 else None
                except EnvdError as exc:
                    if exc.code != "deadline_exceeded":
                        raise
                    why = f"did not finish within {bound:.0f} s (AENV_BUILD_STEP_TIMEOUT)"
                if why is not None:
                    out = "\n".join(tail) or "(no output)"
                    raise StepFailed(f"{what} {why}; last output:\n{out}", name)
            elif step.type == "COPY":
                await self._copy(b, sid, i, step, cfg, ensured, tail)
            # ENV, WORKDIR, USER: configuration only, applied by the caller
        except EnvdError as exc:
            raise StepFailed(f"{what} failed: guest agent: {exc.message}", name) from exc

    async def _copy(self, b: BuildRecord, sid: str, i: int, step: Step, cfg: Config, ensured: set[str],
                    tail: deque[str]) -> None:
        assert step.files_hash is not None
        src, dest, owner, mode = step.args
        path = self.upload_path(step.files_hash)
        what = f"step {i + 1} ({step.describe()})"
        if not path.is_file():
            raise StepFailed(f"{what}: the files with hash {step.files_hash} were not uploaded (PUT them to the "
                             "url that GET /templates/{templateID}/files/{hash} returns)", str(i + 1))
        await self._ensure_workdir(sid, cfg, ensured)
        guest_tar = f"/tmp/.aenv-upload-{step.files_hash[:32]}"

        async def chunks() -> AsyncIterator[bytes]:
            f = await asyncio.to_thread(open, path, "rb")
            try:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    yield chunk
            finally:
                f.close()

        await self.orch.envd(sid).write_file(guest_tar, chunks(), user="root")
        argv = ["/bin/sh", "-c", COPY_SCRIPT, "aenv-copy", guest_tar, src, dest, owner or cfg.user or "", mode,
                cfg.workdir or ""]
        code = await self._run_logged(b, sid, argv, step=str(i + 1), cfg=Config(), user="root", tail=tail)
        if code != 0:
            raise StepFailed(f"{what} failed (exit code {code}): " + ("\n".join(tail) or "(no output)"), str(i + 1))

    async def _start(self, b: BuildRecord, sid: str, cmd: str, cfg: Config, shell: str, tail: deque[str],
                     ended: dict[str, Any]) -> asyncio.Task[None]:
        """The start command as a background process with tag "start"; its output goes to the
        log until the snapshot (the process keeps running when the stream is closed)."""
        events = self.orch.envd(sid).stream(self._argv(shell, cmd), envs=cfg.env, cwd=cfg.workdir, user=cfg.user,
                                            tag="start")
        try:
            first = await anext(events)
        except EnvdError as exc:
            await events.aclose()
            raise StepFailed(f"the start command could not start: guest agent: {exc.message}", "finalize") from exc
        self._log(b, f"start command running (pid {first.pid}, tag \"start\")", step="finalize")
        bufs: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

        async def drain() -> None:
            async with aclosing(events):
                async for ev in events:
                    if ev.type in bufs:
                        for line in _lines(bufs[ev.type], ev.data):
                            tail.append(line)
                            self._log(b, line, step="finalize")
                    elif ev.type == "end":
                        ended["exit_code"] = ev.exit_code

        return asyncio.get_running_loop().create_task(drain())

    async def _wait_ready(self, b: BuildRecord, sid: str, spec: BuildSpec, cfg: Config, shell: str,
                          ended: dict[str, Any], start_tail: deque[str]) -> None:
        assert spec.ready_cmd is not None
        bound = spec.ready_timeout_s or self.orch.settings.build_ready_timeout_s
        self._log(b, f"Waiting for the ready command (up to {bound:.0f}s): {spec.ready_cmd}", step="finalize")
        deadline = time.monotonic() + bound
        last, code = "", None
        while True:
            left = deadline - time.monotonic()
            try:
                said = bytearray()  # the last 2,000 bytes of its output, for the failure's message

                def keep(_kind: str, data: bytes, said: bytearray = said) -> None:
                    said.extend(data)
                    del said[:-2000]

                code = await run_streamed(self.orch.envd(sid), self._argv(shell, spec.ready_cmd), keep,
                                          envs=cfg.env, cwd=cfg.workdir, user=cfg.user,
                                          timeout=max(2.0, min(30.0, left)))
                last = bytes(said).decode(errors="replace").strip()
            except EnvdError as exc:
                code, last = None, f"guest agent: {exc.message}"
            if code == 0:
                self._log(b, "ready command succeeded", step="finalize")
                return
            if "exit_code" in ended:
                raise StepFailed(f"the start command exited (code {ended['exit_code']}) before the ready command "
                                 "succeeded; its last output:\n" + ("\n".join(start_tail) or "(no output)"),
                                 "finalize")
            if time.monotonic() >= deadline:
                raise StepFailed(f"the ready command did not succeed within {bound:g}s: {spec.ready_cmd}\n"
                                 f"its last run exited {code if code is not None else '(no exit code)'} with "
                                 f"output: {last or '(no output)'}", "finalize")
            await asyncio.sleep(READY_INTERVAL_S)
