"""Sandbox lifecycle commands: start, ls, timeout, rm (pause, resume and fork are in saved.py).

Each is one or two API calls; the only logic here is shaping options into request bodies and
answers into a table (or JSON when piped).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import typer
from rich.text import Text

from agentenv.cli.client import ApiClient, client_for
from agentenv.cli.context import CliError
from agentenv.cli.output import (
    Column,
    ObjectOutputOption,
    OutputOption,
    choose_format,
    console,
    explicit_format,
    print_json,
    render,
    status,
)
from agentenv.cli.params import parse_pairs
from agentenv.cli.terminal import run_shell

SHELL_KEEPALIVE_S = 300  # while a shell is attached, the sandbox lives at least this much longer
# Without a state the server lists what E2B clients can parse (running, paused); the CLI shows all.
ALL_STATES = "creating,running,paused,pausing,resuming,snapshotting,forking,killing,error"
CREATE_TIMEOUT = 600.0  # a cold boot under TCG takes minutes; the server enforces its own limit


def start(
    ctx: typer.Context,
    template: Annotated[str, typer.Argument(metavar="TEMPLATE", help="Template (or snapshot id or name) "
                                            "to start from.")] = "base",
    timeout: Annotated[int | None, typer.Option("--timeout", help="Seconds until the sandbox is killed "
                                                "(server default 300).", show_default=False)] = None,
    cpu: Annotated[int | None, typer.Option("--cpu", help="vCPUs (default: the template's).",
                                            show_default=False)] = None,
    memory: Annotated[int | None, typer.Option("--memory", help="Memory in MB (default: the template's).",
                                               show_default=False)] = None,
    metadata: Annotated[list[str] | None, typer.Option("--metadata", "-m", metavar="K=V",
                                                       help="Metadata to attach (repeatable).")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", metavar="K=V",
                                                  help="Environment variable for every command (repeatable).")] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Print the sandbox id and return.")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Do not kill the sandbox when the shell ends.")] = False,
    output: ObjectOutputOption = None,
) -> None:
    """Start a sandbox and open a shell in it (or just print its id with --detach).

    On a terminal the shell is interactive (a remote PTY); with stdin piped, bash runs stdin as
    its script. The exit code is the shell's. While the shell runs the sandbox is kept alive; it
    is killed when the shell ends unless --keep is given."""
    body: dict[str, Any] = {"templateID": template}
    for field, value in (("timeout", timeout), ("cpuCount", cpu), ("memoryMB", memory)):
        if value is not None:
            body[field] = value
    if metadata:
        body["metadata"] = parse_pairs(metadata, "--metadata")
    if env:
        body["envVars"] = parse_pairs(env, "--env")
    with client_for(ctx) as client:
        sandbox = create_or_undo(client, body)
        sid = sandbox["sandboxID"]
        if detach:
            # An id is what scripts want (`SB=$(aenv start -d)`); JSON only when asked for.
            print_json(sandbox) if explicit_format(ctx, output) == "json" else typer.echo(sid)
            return
        err = console(stderr=True)
        err.print(f"sandbox {sid} is running (template {template}); `exit` or Ctrl-D leaves the shell.",
                  markup=False)
        code = 0
        try:
            code = run_shell(client.url, sandbox, refresher(client, sid))
        finally:
            if keep:
                err.print(f"sandbox {sid} kept; `aenv rm {sid}` kills it", markup=False)
            else:
                client.call("DELETE", f"/sandboxes/{sid}")
                err.print(f"sandbox {sid} killed", markup=False)
    raise typer.Exit(code)


def create_or_undo(client: ApiClient, body: dict[str, Any]) -> dict[str, Any]:
    """Create a sandbox; Ctrl-C while it is being made (minutes under TCG) removes it."""
    made = made_or_undone(client, "/sandboxes", body, f"Starting a sandbox from template '{body['templateID']}'…",
                          lambda sandbox: [sandbox["sandboxID"]])
    assert isinstance(made, dict)
    return made


def made_or_undone(client: ApiClient, path: str, body: dict[str, Any], doing: str,
                   ids: Callable[[Any], list[str]]) -> Any:
    """POST a create or fork; Ctrl-C meanwhile kills what it makes. The server goes on with a
    request whose client went, so it carries an Idempotency-Key: asked again with it, the
    server answers with what the first request made once it is made (``ids`` finds the
    sandboxes in that answer), and they are killed."""
    headers = {"Idempotency-Key": f"aenv-{uuid.uuid4().hex}"}
    try:
        with status(doing):
            return client.call("POST", path, json=body, headers=headers, timeout=CREATE_TIMEOUT)
    except KeyboardInterrupt:
        err = console(stderr=True)
        err.print("interrupted: removing what was being made…", markup=False)
        try:
            made = client.call("POST", path, json=body, headers=headers, timeout=CREATE_TIMEOUT)
        except CliError as exc:  # (it failed: nothing to remove)
            err.print(f"nothing to remove: {exc}", markup=False)
            raise typer.Exit(130) from None
        for sid in ids(made):
            try:
                client.call("DELETE", f"/sandboxes/{sid}")
                err.print(f"sandbox {sid} killed", markup=False)
            except CliError as exc:
                err.print(f"sandbox {sid} not killed: {exc}", markup=False)
        raise typer.Exit(130) from None


def refresher(client: ApiClient, sandbox_id: str) -> Callable[[], object]:
    """Keeps a sandbox alive while a shell is attached (refreshes never shorten a timeout)."""
    return lambda: client.call("POST", f"/sandboxes/{sandbox_id}/refreshes", json={"duration": SHELL_KEEPALIVE_S})


def connect(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.", show_default=False)],
    timeout: Annotated[int, typer.Option("--timeout", help="Seconds the sandbox then lives "
                                         "(as E2B's connect: never shortened).")] = 300,
) -> None:
    """Open a shell in a running sandbox, resuming it first if it is paused.

    Like `aenv start`, interactive on a terminal and a script reader with stdin piped; leaving
    the shell leaves the sandbox running."""
    with client_for(ctx) as client:
        with status(f"Connecting to sandbox {sandbox_id}…"):
            sandbox = client.call("POST", f"/sandboxes/{sandbox_id}/connect", json={"timeout": timeout},
                                  timeout=CREATE_TIMEOUT)
        console(stderr=True).print(f"connected to sandbox {sandbox_id}; `exit` or Ctrl-D leaves the shell "
                                   "(the sandbox keeps running).", markup=False)
        code = run_shell(client.url, sandbox, refresher(client, sandbox_id))
    raise typer.Exit(code)


def _local_time(ts: str) -> str:
    try:
        t = datetime.fromisoformat(ts).astimezone()
    except ValueError:
        return ts
    same_day = t.date() == datetime.now().astimezone().date()
    return t.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M")


def _remaining(ts: str) -> str:
    try:
        left = int((datetime.fromisoformat(ts) - datetime.now(timezone.utc)).total_seconds())
    except ValueError:
        return ts
    if left <= 0:
        return "due"
    h, rest = divmod(left, 3600)
    m, s = divmod(rest, 60)
    return "in " + (f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s")


def _state(row: dict[str, Any]) -> Text:
    state = row.get("state", "")
    style = {"running": "green", "error": "red", "paused": "blue"}.get(state, "yellow")  # yellow: in transition
    text = Text(state, style=style or "")
    if row.get("error"):
        text.append(f" ({row['error']})")
    return text


SANDBOX_COLUMNS = [
    Column("ID", lambda r: r["sandboxID"], style="cyan"),
    Column("TEMPLATE", lambda r: r.get("templateID")),
    Column("STATE", _state),
    Column("CPU", lambda r: r.get("cpuCount")),
    Column("MEMORY", lambda r: f"{r.get('memoryMB')} MB"),
    Column("STARTED", lambda r: _local_time(r.get("startedAt", ""))),
    Column("ENDS", lambda r: _remaining(r.get("endAt", ""))),
    Column("METADATA", lambda r: ",".join(f"{k}={v}" for k, v in (r.get("metadata") or {}).items()), wrap=True),
]


def ls(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option("--state", help="Comma-separated states: creating, running, "
                                              "paused, pausing, resuming, snapshotting, forking, killing, "
                                              "error.", show_default=False)] = None,
    metadata: Annotated[list[str] | None, typer.Option("--metadata", "-m", metavar="K=V",
                                                       help="Only sandboxes with this metadata (repeatable).")] = None,
    output: OutputOption = None,
) -> None:
    """List sandboxes."""
    params: dict[str, Any] = {"state": state or ALL_STATES}
    if metadata:
        # E2B's filter encoding, as the SDKs send it: each key and value quoted, then the pairs
        # URL-encoded, so '=', '&' and '%' inside them stay part of them.
        params["metadata"] = urlencode({quote(k, safe=""): quote(v, safe="")
                                        for k, v in parse_pairs(metadata, "--metadata").items()})
    with client_for(ctx) as client:
        rows = client.call("GET", "/sandboxes", params=params)
    render(choose_format(ctx, output), rows, SANDBOX_COLUMNS, empty="no sandboxes")


def set_timeout(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.", show_default=False)],
    seconds: Annotated[int, typer.Argument(help="Seconds from now until the sandbox is killed.",
                                           show_default=False)],
) -> None:
    """Change when a sandbox is killed: SECONDS from now."""
    with client_for(ctx) as client:
        client.call("POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": seconds})
    console(stderr=True).print(f"sandbox {sandbox_id} will be killed in {seconds}s", markup=False)


def rm(
    ctx: typer.Context,
    sandbox_ids: Annotated[list[str] | None, typer.Argument(metavar="ID", help="Sandboxes to kill.",
                                                            show_default=False)] = None,
    all_: Annotated[bool, typer.Option("--all", help="Kill every sandbox.")] = False,
) -> None:
    """Kill sandboxes."""
    if not sandbox_ids and not all_:
        raise typer.BadParameter("give sandbox ids or --all", param_hint="ID")
    err = console(stderr=True)
    with client_for(ctx) as client:
        ids = list(sandbox_ids or [])
        if all_:
            rows = client.call("GET", "/sandboxes", params={"state": ALL_STATES})
            ids += [r["sandboxID"] for r in rows if r["sandboxID"] not in ids]

        named = set(sandbox_ids or [])

        def kill(sid: str) -> str | None:
            try:
                client.call("DELETE", f"/sandboxes/{sid}")
            except CliError as exc:
                if exc.status == 404 and sid not in named:  # listed by --all, gone since
                    return None
                return str(exc)
            return None

        with ThreadPoolExecutor(max_workers=8) as pool:
            failures = 0
            for sid, problem in zip(ids, pool.map(kill, ids), strict=True):
                if problem:
                    failures += 1
                    err.print(f"error: {problem}", markup=False)
                else:
                    typer.echo(sid)
    if all_ and not ids:
        err.print("no sandboxes", style="dim")
    if failures:
        raise typer.Exit(1)
