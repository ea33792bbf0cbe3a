"""What every command shares: the global options and the one error type the CLI prints.

Kept apart from main.py so command modules can import it without importing the app.
"""

from __future__ import annotations

from dataclasses import dataclass

import typer


class CliError(Exception):
    """A failure the user can act on; main.py prints it as ``error: <message>`` and exits 1.

    ``status`` is the HTTP status when the server answered with an error, else None.
    """

    exit_code = 1  # the CLI's exit status for it (2: a usage error, as click's own)

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CommandTimedOut(CliError):
    """A remote command was killed at its --timeout (`aenv exec` exits 124, as timeout(1))."""

    exit_code = 124


class CommandNotStarted(CliError):
    """The sandbox's agent could not start the command: `aenv exec` exits 127 when there is no
    such program and 126 when it cannot be run, as shells and `docker run` do. (The agent
    answers both with envd's invalid_argument; its message tells them apart.)"""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.exit_code = 127 if ("no such executable" in message or "cannot run: No such file" in message) else 126


@dataclass
class Globals:
    """Options given before the command (``aenv --url U --key K -o json ls``)."""

    url: str | None = None
    key: str | None = None
    output: str | None = None  # "table" | "json" | None (= decide by TTY)


def globals_of(ctx: typer.Context) -> Globals:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Globals) else Globals()
