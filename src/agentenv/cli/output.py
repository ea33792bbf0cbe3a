"""How results are shown: rich tables for people, JSON for programs.

A table when stdout is a terminal, JSON when it is piped (so `aenv ls | jq` just works);
``--output table|json`` (before or after the command name) overrides the guess. Consoles are
made per call, so they follow whatever ``sys.stdout`` is at that moment (e.g. a test runner).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentenv.cli.context import globals_of


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


OutputOption = Annotated[
    OutputFormat | None,
    typer.Option("--output", "-o", show_default=False,
                 help="table or json; default: table on a terminal, json when piped."),
]


# Commands that make one thing (start -d, resume, snapshot, pull) print its id, which scripts
# capture; the whole object only when asked for.
ObjectOutputOption = Annotated[
    OutputFormat | None,
    typer.Option("--output", "-o", show_default=False,
                 help="json: print the whole object; default: a short answer (the id)."),
]


def explicit_format(ctx: typer.Context, local: OutputFormat | None = None) -> str | None:
    """The format the user asked for (command option first, then the global one), or None."""
    chosen = local or globals_of(ctx).output
    return OutputFormat(chosen).value if chosen else None


def choose_format(ctx: typer.Context, local: OutputFormat | None = None, *, isatty: bool | None = None) -> str:
    """Return "table" or "json": the explicit choice, else table exactly when stdout is a terminal."""
    chosen = explicit_format(ctx, local)
    if chosen:
        return chosen
    tty = sys.stdout.isatty() if isatty is None else isatty
    return "table" if tty else "json"


def console(*, stderr: bool = False) -> Console:
    # soft_wrap: long lines (paths, messages) are left to the terminal, never broken by rich.
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Column:
    """One table column: its header and how to get the cell (str or rich Text) from a row."""

    header: str
    get: Callable[[dict[str, Any]], Any]
    style: str | None = None
    wrap: bool = False  # only free text wraps; ids, states and numbers stay on one line


def render(fmt: str, rows: Sequence[dict[str, Any]], columns: Sequence[Column], *, empty: str = "nothing to show",
           json_data: Any = None) -> None:
    """Print ``rows`` as a table (or ``json_data``/``rows`` as JSON). Cells are never markup."""
    if fmt == "json":
        print_json(rows if json_data is None else json_data)
        return
    out = console()
    if not rows:
        out.print(Text(empty, style="dim"))
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for c in columns:
        table.add_column(c.header, style=c.style, no_wrap=not c.wrap, overflow="fold" if c.wrap else "ellipsis")
    for row in rows:
        cells = [c.get(row) for c in columns]
        table.add_row(*(v if isinstance(v, Text) else Text("" if v is None else str(v)) for v in cells))
    if out.is_terminal:
        out.print(table)
        return
    # `-o table` into a pipe or file: no width to fit, and no trailing padding.
    wide = Console(highlight=False, width=1000, no_color=True)
    with wide.capture() as captured:
        wide.print(table)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def status(message: str) -> contextlib.AbstractContextManager[Any]:
    """A spinner on stderr while waiting, only when stderr is a terminal."""
    err = console(stderr=True)
    if not err.is_terminal:
        return contextlib.nullcontext()
    return err.status(message)


@contextlib.contextmanager
def transfer(label: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr (terminal only); yields ``advance(nbytes)``."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    err = console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=err, disable=not err.is_terminal)
    with progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def delete_each(client: Any, paths: dict[str, str]) -> None:
    """``DELETE`` every path (label → path): prints each label deleted, an error line for each
    that failed, and exits 1 if any did (the rest are still deleted)."""
    from agentenv.cli.context import CliError

    err = console(stderr=True)
    failures = 0
    for label, path in paths.items():
        try:
            client.call("DELETE", path)
        except CliError as exc:
            failures += 1
            err.print(f"error: {exc}", markup=False)
        else:
            typer.echo(label)
    if failures:
        raise typer.Exit(1)
