"""`aenv template ...`: the templates a server can start sandboxes from (read-only for now)."""

from __future__ import annotations

import typer

from agentenv.cli.client import client_for
from agentenv.cli.output import Column, OutputOption, choose_format, render

app = typer.Typer(help="Templates sandboxes start from.", no_args_is_help=True)

TEMPLATE_COLUMNS = [
    Column("TEMPLATE", lambda t: t["templateID"], style="cyan"),
    Column("CPU", lambda t: t.get("cpuCount")),
    Column("MEMORY", lambda t: f"{t.get('memoryMB')} MB"),
    Column("DISK", lambda t: f"{t.get('diskSizeMB')} MB"),
    Column("STATUS", lambda t: t.get("buildStatus")),
]


@app.command("ls")
def ls(ctx: typer.Context, output: OutputOption = None) -> None:
    """List templates."""
    with client_for(ctx) as client:
        rows = client.call("GET", "/templates")
    render(choose_format(ctx, output), rows, TEMPLATE_COLUMNS, empty="no templates")
