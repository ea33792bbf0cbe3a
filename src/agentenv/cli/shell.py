"""The line-based shell of `aenv start` (until issue #4 brings an interactive PTY shell).

Each line read from stdin runs as its own `bash -l -c` in the sandbox, with output streamed
back; so `cd` and `export` do not carry over between lines. Ends at EOF or `exit [N]`.
"""

from __future__ import annotations

import sys

from agentenv.cli.client import ApiClient
from agentenv.cli.context import CliError
from agentenv.cli.execute import stream_exec
from agentenv.cli.output import console


def line_shell(client: ApiClient, sandbox_id: str) -> int:
    """Run lines until EOF/exit; returns the last command's exit code (like a shell)."""
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 — line editing and history for input()
        except ImportError:
            pass
    err = console(stderr=True)
    last = 0
    while True:
        try:
            line = input(f"{sandbox_id}$ ") if interactive else sys.stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            err.print()
            continue
        if not line:  # EOF
            if interactive:
                err.print()
            return last
        words = line.split()
        if not words:
            continue
        if words[0] in ("exit", "logout"):
            return int(words[1]) if len(words) > 1 and words[1].isdigit() else last
        try:
            last = stream_exec(client, sandbox_id, line.rstrip("\n"))
        except KeyboardInterrupt:
            err.print("^C (stopped showing the output)", markup=False)
            last = 130
        except CliError as exc:
            err.print(f"error: {exc}", markup=False)
            last = 1
            if exc.status == 404 and _gone(client, sandbox_id):
                return last


def _gone(client: ApiClient, sandbox_id: str) -> bool:
    """True when the sandbox no longer exists (killed, or its timeout passed)."""
    try:
        client.call("GET", f"/sandboxes/{sandbox_id}")
    except CliError as exc:
        return exc.status == 404
    return False
