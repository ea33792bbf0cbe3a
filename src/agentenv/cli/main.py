"""The `aenv` typer app: global options, error handling and the wiring of every command.

Commands live in small modules; this file only registers them, so adding one (e.g. the coming
``bench``) is one line. Every ``CliError`` / ``AgentenvError`` escaping a command becomes one
line ``error: <message>`` on stderr and exit code 1 — never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from agentenv import __version__
from agentenv.cli import (
    auth,
    bench,
    doctor,
    execute,
    files,
    image,
    sandbox,
    saved,
    server,
    snapshot,
    template,
)
from agentenv.cli.context import CliError, Globals
from agentenv.cli.output import OutputFormat
from agentenv.errors import AgentenvError


def fail(message: str, code: int = 1) -> typer.Exit:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


class AenvGroup(TyperGroup):
    """Root group that turns expected failures into one readable line."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except AgentenvError as exc:
            raise fail(exc.message) from None
        except BrokenPipeError:
            raise
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            raise fail(f"{exc.strerror or exc}{where}") from None


app = typer.Typer(
    name="aenv",
    cls=AenvGroup,
    help="AgentENV: self-hosted microVM sandboxes speaking the E2B API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"aenv {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option("--url", envvar="AENV_URL", show_default=False,
                                            help="Server URL; default: saved by `aenv auth`, "
                                                 "else http://127.0.0.1:8000.")] = None,
    key: Annotated[str | None, typer.Option("--key", envvar="AENV_API_KEY", show_default=False,
                                            help="API key; default: saved by `aenv auth`, "
                                                 "else the server's key file.")] = None,
    output: Annotated[OutputFormat | None, typer.Option("--output", "-o", show_default=False,
                                                        help="table or json; default: table on a "
                                                             "terminal, json when piped.")] = None,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print aenv's version and exit.")] = False,
) -> None:
    ctx.obj = Globals(url=url, key=key, output=output.value if output else None)



# Host
app.command("serve")(server.serve)
app.command("setup")(server.setup)
app.command("doctor")(doctor.doctor)
app.command("auth")(auth.auth)
# Sandboxes
app.command("start")(sandbox.start)
app.command("connect")(sandbox.connect)
app.command("exec", context_settings=execute.CONTEXT, cls=execute.ExecCommand)(execute.exec_command)
app.command("ls")(sandbox.ls)
app.command("timeout")(sandbox.set_timeout)
app.command("rm")(sandbox.rm)
app.command("upload")(files.upload)
app.command("download")(files.download)
# Saved states
app.command("pause")(saved.pause)
app.command("resume")(saved.resume)
app.add_typer(snapshot.app, name="snapshot")
app.command("fork")(saved.fork)
# Templates and measurements
app.add_typer(template.app, name="template")
app.command("pull")(image.pull)
app.command("bench")(bench.bench)


if __name__ == "__main__":
    app()
