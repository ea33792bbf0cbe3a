"""`aenv snapshot ...`: named, reusable saved states of sandboxes.

``aenv snapshot create ID`` is the canonical form; ``aenv snapshot ID`` is short for it (the
group reads any first word that is not one of its commands as a sandbox id). A sandbox starts
from a snapshot with ``aenv start <snapshot id or name>``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from agentenv.cli.client import client_for
from agentenv.cli.output import (
    Column,
    ObjectOutputOption,
    OutputOption,
    choose_format,
    console,
    delete_each,
    explicit_format,
    print_json,
    render,
    status,
)
from agentenv.cli.sandbox import CREATE_TIMEOUT


class DefaultCreateGroup(TyperGroup):
    """A group where ``snapshot ID ...`` means ``snapshot create ID ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["create", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=DefaultCreateGroup, no_args_is_help=True,
                  help="Saved states of sandboxes (`aenv snapshot ID` is short for `aenv snapshot create ID`).")


@app.command("create")
def create(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox to snapshot.", show_default=False)],
    name: Annotated[str | None, typer.Option("--name", help="A name to start sandboxes from instead of the id.",
                                             show_default=False)] = None,
    filesystem_only: Annotated[bool, typer.Option(
        "--filesystem-only", help="Save only the disk (the guest flushes its files first); sandboxes "
        "started from it boot it.")] = False,
    output: ObjectOutputOption = None,
) -> None:
    """Save a running sandbox's state (it keeps running); prints the snapshot id."""
    body: dict[str, Any] = {} if name is None else {"name": name}
    if filesystem_only:
        body["memory"] = False
    with client_for(ctx) as client:
        with status(f"Snapshotting sandbox {sandbox_id}…"):
            snap = client.call("POST", f"/sandboxes/{sandbox_id}/snapshots", json=body, timeout=CREATE_TIMEOUT)
    sid = snap["snapshotID"]
    if explicit_format(ctx, output) == "json":
        print_json(snap)
        return
    typer.echo(sid)
    console(stderr=True).print(f"snapshot of sandbox {sandbox_id} saved; `aenv start {name or sid}` starts a "
                               "sandbox from it", markup=False)


def _created(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "" if ts is None else str(ts)
    t = datetime.fromtimestamp(ts).astimezone()
    same_day = t.date() == datetime.now().astimezone().date()
    return t.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M")


SNAPSHOT_COLUMNS = [
    Column("SNAPSHOT", lambda s: s["snapshotID"], style="cyan"),
    Column("NAME", lambda s: ",".join(s.get("names") or [])),
    Column("SANDBOX", lambda s: s.get("sandboxID")),
    Column("TEMPLATE", lambda s: s.get("templateID")),
    Column("CPU", lambda s: s.get("cpuCount")),
    Column("MEMORY", lambda s: f"{s.get('memoryMB')} MB"),
    Column("CREATED", lambda s: _created(s.get("createdAt"))),
]


@app.command("ls")
def ls(
    ctx: typer.Context,
    sandbox: Annotated[str | None, typer.Option("--sandbox", metavar="ID", help="Only snapshots of this sandbox.",
                                                show_default=False)] = None,
    name: Annotated[str | None, typer.Option("--name", help="Only the snapshot with this name.",
                                             show_default=False)] = None,
    output: OutputOption = None,
) -> None:
    """List snapshots."""
    params = {k: v for k, v in (("sandboxID", sandbox), ("name", name)) if v}
    with client_for(ctx) as client:
        rows = client.call_pages("/snapshots", params)
    render(choose_format(ctx, output), rows, SNAPSHOT_COLUMNS, empty="no snapshots")


@app.command("rm")
def rm(
    ctx: typer.Context,
    snapshots: Annotated[list[str], typer.Argument(metavar="ID_OR_NAME", help="Snapshots to delete.",
                                                   show_default=False)],
) -> None:
    """Delete snapshots (sandboxes already started from them are not affected)."""
    with client_for(ctx) as client:
        delete_each(client, {s: f"/snapshots/{s}" for s in snapshots})
