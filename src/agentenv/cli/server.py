"""Host-side commands: `aenv serve` and `aenv setup` (`aenv doctor` is in doctor.py).

Flags are turned into AENV_* environment variables and then read by ``Settings.from_env``,
so there is one way configuration is read. The server stack (fastapi, orchestrator) is
imported inside `serve` only, keeping every other command fast to start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from agentenv.cli.context import CliError
from agentenv.cli.output import console

DataDirOpt = Annotated[Path | None, typer.Option("--data-dir", envvar="AENV_DATA_DIR", show_default=False,
                                                 help="State, keys and images; default /var/lib/agentenv.")]


def settings_from(**env: object):  # type: ignore[no-untyped-def]
    """``Settings.from_env()`` after setting the given AENV_* variables (None = leave as is)."""
    from agentenv.config import Settings

    for name, value in env.items():
        if value is not None:
            os.environ[name] = str(value)
    try:
        return Settings.from_env()
    except ValueError as exc:
        raise CliError(f"invalid configuration: {exc}") from exc


def serve(
    host: Annotated[str | None, typer.Option("--host", envvar="AENV_HOST", show_default=False,
                                             help="Listen address; default 127.0.0.1.")] = None,
    port: Annotated[int | None, typer.Option("--port", envvar="AENV_PORT", show_default=False,
                                             help="Listen port; default 8000.")] = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Run the AgentENV server (needs root and `aenv setup` done first)."""
    settings = settings_from(AENV_HOST=host, AENV_PORT=port, AENV_DATA_DIR=data_dir)
    from agentenv.server import serve as run_server  # heavy: fastapi, orchestrator

    console(stderr=True).print(f"starting AgentENV on http://{settings.host}:{settings.port} "
                               f"(data in {settings.data_dir})", markup=False)
    run_server(settings)


def setup(
    data_dir: DataDirOpt = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", envvar="AENV_CACHE_DIR", show_default=False,
                                                   help="Guest image cache; default <data-dir>/cache.")] = None,
    skip_apt: Annotated[bool, typer.Option("--skip-apt", help="Do not install Debian packages.")] = False,
) -> None:
    """Install host packages and build the guest images (idempotent; a second run is quick)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from agentenv.images.provision import STEPS, provision

    settings = settings_from(AENV_DATA_DIR=data_dir, AENV_CACHE_DIR=cache_dir)
    out = console()
    out.print(f"Provisioning guest images in {escape(str(settings.cache))}")
    done = 0
    summary = ""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=out, transient=True, disable=not out.is_terminal) as progress:
        task = progress.add_task(f"{STEPS[0]}…", total=None)

        def on_step(line: str) -> None:
            nonlocal done, summary
            if done < len(STEPS):
                out.print(f"[green]✓[/green] {escape(line)}")
                if done + 1 < len(STEPS):
                    progress.reset(task, description=f"{STEPS[done + 1]}…")  # restarts the clock too
            else:
                summary = line
            done += 1

        try:
            artifacts = provision(settings.cache, apt=not skip_apt, progress=on_step)
        except BaseException:
            if done < len(STEPS):
                out.print(f"[red]✗[/red] {STEPS[done]} failed")
            raise
    out.print(f"[bold]{escape(summary)}[/bold]")
    for name, path in artifacts.to_json().items():
        out.print(f"  {name:<9} {escape(path)}")
    out.print("next: `aenv serve` (as root), then `aenv doctor` to check the host", markup=False)
