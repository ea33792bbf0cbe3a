"""`aenv auth`: remember which server to talk to and with which key.

So that everyday commands need no flags: the key of a local server is picked up from its data
dir once (as root), then lives in the user's own 0600 credentials file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentenv.cli import credentials
from agentenv.cli.client import ApiClient
from agentenv.cli.context import CliError, globals_of
from agentenv.cli.output import console


def auth(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option("--url", help="Server URL; default: the saved one, "
                                            "else http://127.0.0.1:8000.", show_default=False)] = None,
    key: Annotated[str | None, typer.Option("--key", help="API key; default: read from <data-dir>/api_key.",
                                            show_default=False)] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", envvar="AENV_DATA_DIR", show_default=False,
                                                  help="Server data dir holding api_key; "
                                                       "default /var/lib/agentenv.")] = None,
) -> None:
    """Save the server URL and API key to ~/.config/agentenv/credentials.json (mode 0600)."""
    g = globals_of(ctx)
    directory = data_dir or credentials.data_dir()
    try:
        saved = credentials.load().get("url")
    except CliError:
        saved = None  # unreadable: replaced below
    chosen = credentials.normalize_url(url or g.url or saved or credentials.DEFAULT_URL)
    # The data dir's key is a server on this host's: never sent to a remote one to "verify" it.
    key = key or g.key or (credentials.read_key_file(directory) if credentials.is_local(chosen) else None)
    if not key:
        raise CliError(f"no API key given and {directory / 'api_key'} is not readable (or is a local "
                       f"server's, and {chosen} is not local); pass --key, or run `sudo aenv auth` on the server host")
    out = console(stderr=True)
    # Checked before it is saved: a key the server refuses must not replace a good one. A
    # server that cannot be reached now is no reason to refuse (it may be started later).
    client = ApiClient(chosen, key, timeout=3.0)  # a key that cannot go in a header: CliError
    verified = False
    try:
        with client:
            client.call("GET", "/templates")
        verified = True
    except CliError as exc:
        if exc.status == 401:
            raise CliError(f"the server at {chosen} refused this key; nothing was saved") from None
        warning = f"warning: could not verify the key: {exc}"
    path = credentials.save(chosen, key)
    out.print(f"saved credentials for {chosen} to {path} (mode 0600)", markup=False)
    if verified:
        out.print(f"the server at {chosen} accepted the key", markup=False)
    else:
        out.print(warning, style="yellow", markup=False)
