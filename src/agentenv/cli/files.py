"""`aenv upload` / `aenv download`: copy files to and from a sandbox.

Both directions stream in fixed-size chunks, so a multi-GB file never sits in memory; a
download lands in a temporary name first, so an interrupted one leaves no truncated file.
``-`` means stdin / stdout.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, BinaryIO

import typer

from agentenv.cli.client import STREAM_TIMEOUT, client_for
from agentenv.cli.output import transfer

CHUNK = 1 << 20

SandboxArg = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.", show_default=False)]
UserOpt = Annotated[str | None, typer.Option("--user", "-u", help="Sandbox user owning the file "
                                             "(default: user).", show_default=False)]


def _params(path: str, user: str | None) -> dict[str, str]:
    return {"path": path, **({"user": user} if user else {})}


def upload(
    ctx: typer.Context,
    sandbox_id: SandboxArg,
    local: Annotated[str, typer.Argument(help="Local file, or - for stdin.", show_default=False)],
    remote: Annotated[str, typer.Argument(help="Path in the sandbox; ending in / keeps the local name.",
                                          show_default=False)],
    user: UserOpt = None,
) -> None:
    """Copy a local file into a sandbox."""
    headers = {"Content-Type": "application/octet-stream"}
    if local == "-":
        source: BinaryIO = sys.stdin.buffer
        size = None
    else:
        path = Path(local)
        if not path.is_file():
            raise typer.BadParameter(f"{local} is not a file", param_hint="LOCAL")
        source = path.open("rb")
        # The size lets the server see it (no chunked encoding): the bytes the file has now,
        # not more if it grows meanwhile (a log being written). A file whose size says 0
        # (/proc/cpuinfo) goes chunked, all of it.
        size = path.stat().st_size or None
        if size:
            headers["Content-Length"] = str(size)
        if remote.endswith("/"):
            remote += path.name
    owned = contextlib.nullcontext() if local == "-" else source  # never close our own stdin
    with owned, transfer(f"upload {PurePosixPath(remote).name}", size) as advance:

        def chunks() -> Iterator[bytes]:
            left = size
            while data := source.read(CHUNK if left is None else min(CHUNK, left)):
                advance(len(data))
                yield data
                if left is not None and not (left := left - len(data)):
                    return

        with client_for(ctx) as client:
            client.call("PUT", f"/sandboxes/{sandbox_id}/files", params=_params(remote, user), content=chunks(),
                        headers=headers, timeout=STREAM_TIMEOUT)


def download(
    ctx: typer.Context,
    sandbox_id: SandboxArg,
    remote: Annotated[str, typer.Argument(help="Path in the sandbox.", show_default=False)],
    local: Annotated[str, typer.Argument(help="Local file or directory, or - for stdout.", show_default=False)],
    user: UserOpt = None,
) -> None:
    """Copy a file out of a sandbox."""
    with client_for(ctx) as client, client.stream("GET", f"/sandboxes/{sandbox_id}/files",
                                                  params=_params(remote, user)) as resp:
        total = int(resp.headers["content-length"]) if "content-length" in resp.headers else None
        if local == "-":
            _copy(resp, sys.stdout.buffer, None, total)
            sys.stdout.buffer.flush()
            return
        dest = Path(local)
        if dest.is_dir():
            dest = dest / PurePosixPath(remote).name
        if dest.is_symlink():
            dest = dest.resolve()  # the file the link names gets the content; the link stays
        if dest.exists() and not dest.is_file():
            # A device, a FIFO, /dev/fd/N (a shell's >(...)): written to, never replaced by a
            # regular file (as root, a rename would put one in place of /dev/null).
            with dest.open("wb") as f:
                _copy(resp, f, dest.name, total)
            return
        tmp = dest.with_name(f".{dest.name}.aenv-part")
        try:
            with tmp.open("wb") as f:
                _copy(resp, f, dest.name, total)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)


def _copy(resp: Any, sink: BinaryIO, label: str | None, total: int | None) -> None:
    with transfer(f"download {label}" if label else "download", total) as advance:
        for chunk in resp.iter_bytes(CHUNK):
            sink.write(chunk)
            advance(len(chunk))
