"""`aenv pull IMAGE`: make a template from any OCI image (``POST /images/pull``)."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from agentenv.cli.client import client_for
from agentenv.cli.context import CliError
from agentenv.cli.output import (
    ObjectOutputOption,
    console,
    explicit_format,
    print_json,
    status,
)

PULL_TIMEOUT = 1800.0  # a large image over a slow registry


def pull(
    ctx: typer.Context,
    image: Annotated[str, typer.Argument(metavar="IMAGE", show_default=False,
                                         help="Image reference: ubuntu:22.04, alpine, registry:5000/team/app@sha256:…")],
    name: Annotated[str | None, typer.Option("--name", "-n", show_default=False,
                                             help="Template name (default: the image's last path component).")] = None,
    username: Annotated[str | None, typer.Option("--username", "-u", show_default=False,
                                                 help="Registry user; the password is read from "
                                                      "--password-stdin or $AENV_REGISTRY_PASSWORD.")] = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the registry password from stdin.")] = False,
    disk_mb: Annotated[int | None, typer.Option("--disk-mb", show_default=False,
                                                help="Size of the template's disk in MiB (default 4096).")] = None,
    output: ObjectOutputOption = None,
) -> None:
    """Pull an image from any OCI registry and make it a template; `aenv start NAME` then runs it."""
    body: dict[str, Any] = {"image": image}
    if name:
        body["name"] = name
    if disk_mb is not None:
        body["diskSizeMB"] = disk_mb
    if username:
        password = sys.stdin.readline().rstrip("\n") if password_stdin else os.environ.get("AENV_REGISTRY_PASSWORD")
        if not password:
            raise CliError("--username needs a password: pass --password-stdin or set AENV_REGISTRY_PASSWORD")
        body.update(username=username, password=password)
    with client_for(ctx) as client:
        with status(f"Pulling {image}…"):
            t = client.call("POST", "/images/pull", json=body, timeout=PULL_TIMEOUT)
    if explicit_format(ctx, output) == "json":
        print_json(t)
        return
    # Its id on stdout, as `start -d` and `snapshot` print theirs (T=$(aenv pull alpine)); the
    # sentence for a person on stderr.
    digest = (t.get("image") or {}).get("digest", "")
    typer.echo(t["templateID"])
    console(stderr=True).print(f"template [cyan]{t['templateID']}[/] from {(t.get('image') or {}).get('ref', image)} "
                               f"({digest[:19]}); start it with `aenv start {t['templateID']}`")
