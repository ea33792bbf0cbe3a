"""`aenv template ...`: the templates a server can start sandboxes from; build new ones from a
build file (docs/mechanisms/template-builds.md)."""

from __future__ import annotations

import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.text import Text

from agentenv.cli.client import client_for
from agentenv.cli.context import CliError
from agentenv.cli.dockerfile import BuildFileError, files_hash, parse, tar_gz
from agentenv.cli.output import (
    Column,
    OutputOption,
    choose_format,
    console,
    delete_each,
    render,
)

app = typer.Typer(help="Templates sandboxes start from: list, build, remove (`aenv pull IMAGE` makes one "
                       "from an OCI image).", no_args_is_help=True)

TEMPLATE_COLUMNS = [
    Column("TEMPLATE", lambda t: t["templateID"], style="cyan"),
    Column("BUILD", lambda t: "built-in" if t.get("isDefault") else t.get("buildID")),
    Column("CPU", lambda t: t.get("cpuCount")),
    Column("MEMORY", lambda t: f"{t.get('memoryMB')} MB"),
    Column("DISK", lambda t: f"{t.get('diskSizeMB')} MB"),
    Column("STATUS", lambda t: t.get("buildStatus")),
]

BUILD_FILE_HELP = """\
Build a template from a build file and a context directory, printing the build's log.

The steps run in a sandbox of the FROM template, which is then snapshotted with its memory: `aenv start NAME` starts sandboxes with the start command already running. Leading steps unchanged since the last build are reused (their log lines say CACHED).

Build file (default: aenv.Dockerfile, else Dockerfile, in CONTEXT):

\b
  FROM base                   template name, or image ref (has / : or .)
  RUN apt-get update && \\
      apt-get install -y jq   (a trailing backslash continues a line)
  RUN --user=root cmd         one step as another user
  ENV KEY=value K2="a b"      or: ENV KEY value
  WORKDIR /app                later steps and sandboxes start here
  USER user                   later steps and sandboxes run as this user
  COPY [--chown=u[:g]] [--chmod=0755] src... dest
  START_CMD python3 -m http.server 8000       (or CMD / ENTRYPOINT)
  READY_CMD curl -sf http://127.0.0.1:8000/   build waits for exit 0

Exit code 0 when the template is ready, 1 when the build fails.
"""


def _default_file(context: Path) -> Path:
    for name in ("aenv.Dockerfile", "Dockerfile"):
        if (context / name).is_file():
            return context / name
    raise CliError(f"no aenv.Dockerfile or Dockerfile in {context}; give one with -f")


def _printer() -> Any:
    err = console()
    tty = err.is_terminal

    def show(entry: dict[str, Any]) -> None:
        msg, level = entry.get("message", ""), entry.get("level", "info")
        if level == "debug":
            return
        if not tty:
            sys.stdout.write(f"{msg}\n")
            sys.stdout.flush()
            return
        ts = entry.get("timestamp", "")
        try:
            clock = datetime.fromisoformat(ts).astimezone().strftime("%H:%M:%S")
        except ValueError:
            clock = ""
        style = "red" if level == "error" else "yellow" if level == "warn" else None
        if msg.startswith("CACHED"):
            style = "dim"
        elif re.match(r"\[\d+/\d+\] ", msg):
            style = "bold"
        line = Text(f"{clock} ", style="dim")
        line.append(msg, style=style)
        err.print(line)

    return show


@app.command("ls")
def ls(ctx: typer.Context, output: OutputOption = None) -> None:
    """List templates: built-in ones and built ones."""
    with client_for(ctx) as client:
        rows = client.call("GET", "/templates")
    render(choose_format(ctx, output), rows, TEMPLATE_COLUMNS, empty="no templates")


@app.command("build", help=BUILD_FILE_HELP)
def build(
    ctx: typer.Context,
    context: Annotated[Path, typer.Argument(help="Context directory: COPY sources are read from it.",
                                            show_default="current directory")] = Path("."),
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Build file.",
                                              show_default="aenv.Dockerfile or Dockerfile in CONTEXT")] = None,
    name: Annotated[str | None, typer.Option("--name", "-n", help="Template name (name or name:tag).",
                                             show_default="the context directory's name")] = None,
    cpu: Annotated[int | None, typer.Option("--cpu", help="vCPUs of the template.", show_default=False)] = None,
    memory: Annotated[int | None, typer.Option("--memory", help="Memory of the template in MiB.",
                                               show_default=False)] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Run every step again.")] = False,
    ready_timeout: Annotated[float | None, typer.Option("--ready-timeout", help="Seconds to wait for READY_CMD.",
                                                        show_default="the server's, 120")] = None,
) -> None:
    context = context.resolve()
    if not context.is_dir():
        raise CliError(f"context {context} is not a directory")
    path = file or _default_file(context)
    try:
        spec = parse(path.read_text())
    except BuildFileError as exc:
        raise CliError(f"{path}: {exc}") from None
    except UnicodeDecodeError:
        raise CliError(f"{path} is not a UTF-8 text file (a build file, e.g. aenv.Dockerfile, is)") from None
    template = name or re.sub(r"[^A-Za-z0-9_-]", "-", context.name).strip("-_") or "template"
    body = spec.body
    if no_cache:
        body["force"] = True
    if ready_timeout is not None:
        body["readyTimeout"] = ready_timeout
    # The COPY sources are read first: a missing one fails before the server reserves a build.
    hashes = []
    for c in spec.copies:
        try:
            hashes.append(files_hash(context, c.sources[0], body["steps"][c.step]["args"][1]))
        except BuildFileError as exc:
            raise CliError(str(exc)) from None
    show = _printer()
    t0 = time.monotonic()
    with client_for(ctx, timeout=120) as client:
        req: dict[str, Any] = {"name": template}
        if cpu is not None:
            req["cpuCount"] = cpu
        if memory is not None:
            req["memoryMB"] = memory
        made = client.call("POST", "/v3/templates", json=req)
        tid, bid = made["templateID"], made["buildID"]
        for c, h in zip(spec.copies, hashes, strict=True):
            body["steps"][c.step]["filesHash"] = h
            link = client.call("GET", f"/templates/{tid}/files/{h}")
            if not link.get("present"):
                with tempfile.TemporaryFile() as data:
                    tar_gz(context, c.sources[0], data)
                    size = data.tell()
                    data.seek(0)
                    try:  # httpx streams a file in pieces, with its length
                        r = httpx.put(link["url"], content=data, timeout=3600, trust_env=False)
                    except httpx.HTTPError as exc:
                        raise CliError(f"upload of COPY {c.sources[0]} failed: {exc}") from None
                if r.is_error:
                    raise CliError(f"upload of COPY {c.sources[0]} failed: HTTP {r.status_code} {r.text[:200]}")
                show({"message": f"uploaded {c.sources[0]} ({size} bytes)", "level": "info"})
        client.call("POST", f"/v2/templates/{tid}/builds/{bid}", json=body)
        offset, status = 0, "building"
        while True:
            st = client.call("GET", f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": offset})
            for e in st.get("logEntries", []):
                show(e)
            offset += len(st.get("logEntries", []))
            status = st["status"]
            if status in ("ready", "error") and not st.get("logEntries"):
                break
            time.sleep(0.3)
    took = time.monotonic() - t0
    err = console(stderr=True)
    if status == "error":
        reason = (st.get("reason") or {}).get("message", "unknown error")
        raise CliError(f"build {bid} of template '{tid}' failed after {took:.1f}s: {reason}")
    err.print(f"template '{tid}' built in {took:.1f}s (build {bid}); `aenv start {tid}` starts a sandbox of it",
              markup=False)


@app.command("rm")
def rm(
    ctx: typer.Context,
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="Built templates to remove.",
                                               show_default=False)],
) -> None:
    """Remove built templates (sandboxes already started from them keep running)."""
    with client_for(ctx) as client:
        delete_each(client, {n: f"/templates/{n}" for n in names})
