"""Saved-state commands on one sandbox: pause, resume, fork (snapshots are in snapshot.py).

Each is one API call that may take a while (the server writes or loads guest memory), so they
wait as long as ``start`` does and show a spinner on a terminal.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from agentenv.cli.client import client_for
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
from agentenv.cli.sandbox import CREATE_TIMEOUT, made_or_undone

SandboxId = Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.", show_default=False)]


def pause(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    filesystem_only: Annotated[bool, typer.Option(
        "--filesystem-only", help="Keep only the disk (the guest flushes its files first); resuming boots it "
        "again, without its processes.")] = False,
) -> None:
    """Pause a running sandbox: its memory and disk are saved and it stops using CPU. Its RAM is
    given back when the node needs it, and at the latest AENV_PAUSE_LINGER_S (60 s) after the
    pause; a resume before then continues the same VM (milliseconds instead of a restore)."""
    body = {"memory": False} if filesystem_only else {}
    with client_for(ctx) as client:
        with status(f"Pausing sandbox {sandbox_id}…"):
            client.call("POST", f"/sandboxes/{sandbox_id}/pause", json=body, timeout=CREATE_TIMEOUT)
    console(stderr=True).print(f"sandbox {sandbox_id} paused; `aenv resume {sandbox_id}` resumes it", markup=False)


def resume(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    timeout: Annotated[int | None, typer.Option("--timeout", help="Seconds from now until the sandbox is killed "
                                                "(server default 300).", show_default=False)] = None,
    reboot: Annotated[bool, typer.Option(
        "--reboot", help="Boot its disk instead of restoring its memory (what a --filesystem-only pause "
        "always does).")] = False,
    output: ObjectOutputOption = None,
) -> None:
    """Resume a paused sandbox where it left off; prints its id (the sandbox as JSON with -o json)."""
    body: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if reboot:
        body["memory"] = False
    with client_for(ctx) as client:
        with status(f"Resuming sandbox {sandbox_id}…"):
            sandbox = client.call("POST", f"/sandboxes/{sandbox_id}/resume", json=body, timeout=CREATE_TIMEOUT)
    print_json(sandbox) if explicit_format(ctx, output) == "json" else typer.echo(sandbox["sandboxID"])


def _outcome(item: dict[str, Any]) -> Text:
    if "sandbox" in item:
        return Text("running", style="green")
    err = item.get("error") or {}
    return Text(f"error {err.get('code')}: {err.get('message')}", style="red")


FORK_COLUMNS = [
    Column("CHILD", lambda r: r["child"]),
    Column("ID", lambda r: (r.get("sandbox") or {}).get("sandboxID", "-"), style="cyan"),
    Column("TEMPLATE", lambda r: (r.get("sandbox") or {}).get("templateID", "-")),
    Column("RESULT", _outcome, wrap=True),
]


def fork(
    ctx: typer.Context,
    sandbox_id: SandboxId,
    count: Annotated[int, typer.Option("--count", "-n", min=1,
                                       help="How many copies to start (up to the server's AENV_MAX_FORK, 20 by default).")] = 1,
    timeout: Annotated[int | None, typer.Option("--timeout", help="Seconds until each copy is killed "
                                                "(default: the parent's).", show_default=False)] = None,
    output: OutputOption = None,
) -> None:
    """Start running copies of a sandbox (memory, processes and disk as they are now).

    Prints one row per copy: its id, or why it failed; exits 1 if any copy failed.
    """
    body: dict[str, Any] = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    with client_for(ctx) as client:
        items = made_or_undone(client, f"/sandboxes/{sandbox_id}/fork", body,
                               f"Forking sandbox {sandbox_id} ({count} {'copy' if count == 1 else 'copies'})…",
                               lambda items: [item["sandbox"]["sandboxID"] for item in items if "sandbox" in item])
    rows = [{"child": i, **item} for i, item in enumerate(items, 1)]
    render(choose_format(ctx, output), rows, FORK_COLUMNS, empty="no copies", json_data=items)
    failed = sum(1 for item in items if "sandbox" not in item)
    if failed:
        raise CliError(f"{failed} of {len(items)} copies of sandbox {sandbox_id} failed")
