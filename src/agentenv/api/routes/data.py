"""Native data-plane routes: run a command and move files (issue #4 adds the E2B envd proxy).

Command output and file contents stream in both directions; nothing is buffered whole.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from agentenv.api.models import ExecRequest, ExecResult
from agentenv.api.routes import orch_of
from agentenv.envd_client import EnvdError, ProcessEvent

router = APIRouter()


# An exec stream silent this long gets a ``{"type": "keepalive"}`` line: a client can then tell a
# quiet command from a stuck server or network with a read timeout (aenv exec: 60 s).
EXEC_KEEPALIVE_S = 15.0


def _timeout(t: float | None) -> float | None:
    return None if not t else t


async def _with_keepalives(events: AsyncIterator[ProcessEvent], every: float) -> AsyncIterator[ProcessEvent | None]:
    """``events``, with a None after every ``every`` seconds without one. The pending read
    is waited on, not cancelled, at each tick (cancelling it would end the stream)."""
    pending = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(events))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


@router.post("/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
async def exec_command(sandbox_id: str, body: ExecRequest, request: Request) -> Response:
    orch = orch_of(request)
    if body.stream:
        events = orch.exec_stream(sandbox_id, body.cmd, envs=body.envs, cwd=body.cwd, user=body.user,
                                  timeout=_timeout(body.timeout))

        async def ndjson() -> AsyncIterator[bytes]:
            # One decoder per stream: a character split across chunks is whole, and bytes that
            # are not UTF-8 come as lone surrogates U+DC80..U+DCFF (Python's surrogateescape),
            # so a client gets the exact bytes back (aenv exec does: binary output passes).
            decoders = {k: codecs.getincrementaldecoder("utf-8")("surrogateescape")
                        for k in ("stdout", "stderr", "pty")}
            pid, ended = None, False
            try:
                async for ev in _with_keepalives(events, EXEC_KEEPALIVE_S):
                    if ev is None:
                        yield b'{"type": "keepalive"}\n'
                        continue
                    d: dict[str, object] = {"type": ev.type}
                    if ev.type == "start":
                        d["pid"] = pid = ev.pid
                    elif ev.type in decoders:
                        d["data"] = decoders[ev.type].decode(ev.data)
                        if not d["data"]:
                            continue
                    elif ev.type == "end":
                        for kind, dec in decoders.items():  # an incomplete character at the end
                            if rest := dec.decode(b"", final=True):
                                yield json.dumps({"type": kind, "data": rest}).encode() + b"\n"
                        ended = True
                        d.update(exitCode=ev.exit_code, status=ev.status, error=ev.error)
                    yield json.dumps(d).encode() + b"\n"
            except Exception as exc:  # noqa: BLE001 — the 200 is sent: report in the stream
                msg = exc.message if isinstance(exc, EnvdError) else f"lost the guest agent: {exc!r}"
                code = exc.code if isinstance(exc, EnvdError) else "unavailable"  # deadline_exceeded: --timeout
                yield json.dumps({"type": "error", "message": msg, "code": code}).encode() + b"\n"
            finally:
                if pid is not None and not ended:
                    # The client went away (Ctrl-C on aenv exec) before the end: the command
                    # goes too, as a local one would with its terminal.
                    orch.abandon_command(sandbox_id, pid)

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")
    res = await orch.exec(sandbox_id, body.cmd, envs=body.envs, cwd=body.cwd, user=body.user,
                          timeout=_timeout(body.timeout))
    out = ExecResult(exitCode=res.exit_code, stdout=res.stdout.decode(errors="replace"),
                     stderr=res.stderr.decode(errors="replace"), error=res.error)
    return Response(out.model_dump_json(), media_type="application/json")


@router.get("/sandboxes/{sandbox_id}/files")
async def read_file(sandbox_id: str, request: Request, path: str = Query(min_length=1),
                    user: str | None = None) -> StreamingResponse:
    envd = orch_of(request).envd(sandbox_id)
    chunks = envd.download(path, user=user)
    first = await anext(chunks, b"")  # surface a missing file as 404 before the 200 is sent

    async def body() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for c in chunks:
            yield c

    return StreamingResponse(body(), media_type="application/octet-stream")


@router.put("/sandboxes/{sandbox_id}/files", status_code=204, response_class=Response)
async def write_file(sandbox_id: str, request: Request, path: str = Query(min_length=1),
                     user: str | None = None) -> Response:
    envd = orch_of(request).envd(sandbox_id)
    await envd.write_file(path, request.stream(), user=user)
    return Response(status_code=204)
