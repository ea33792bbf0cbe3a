"""`aenv exec`: run one command in a sandbox, streaming its output as it happens.

The server answers ``stream=true`` with NDJSON events (start, stdout/stderr chunks, end); they
are copied to the local stdout/stderr at once, and the CLI exits with the command's exit code,
so `aenv exec` composes in scripts like a local command. With ``-i`` the local stdin is the
command's (``tar c . | aenv exec -i ID -- tar x -C /work``): that run goes over envd's
Connect protocol through the server's sandbox proxy, as `aenv connect` does, since the
server's exec route carries no input.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperOption

from agentenv.cli.client import EXEC_TIMEOUT, ApiClient, client_for
from agentenv.cli.context import CliError, CommandNotStarted, CommandTimedOut
from agentenv.cli.exitstatus import exit_status
from agentenv.cli.params import parse_pairs
from agentenv.cli.terminal import run_piped
from agentenv.errors import AgentenvError

# `aenv exec ID ls -la` passes -la on to the command: options after the command's first word
# are the command's (ExecCommand); before it, -h and --help are ours.
CONTEXT = {"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


class ExecCommand(TyperCommand):
    """Our options go between ID and the command; from the command's first word on, every
    argument is the command's, as if ``--`` stood before it (``aenv exec ID grep -e x f`` keeps
    its ``-e``, which click would otherwise take as ``--env``)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        options = {name for p in self.params if isinstance(p, TyperOption) for name in (*p.opts, *p.secondary_opts)}
        takes_value = {name for p in self.params if isinstance(p, TyperOption) and not p.is_flag
                       for name in p.opts}
        ours = options | set(CONTEXT["help_option_names"])
        positional, i = 0, 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                break
            if arg.startswith("-") and arg != "-":
                i += 1 + _option_consumes_next(arg, ours, takes_value)
                continue
            positional += 1
            if positional == 2:  # the command's first word
                args = [*args[:i], "--", *args[i:]]
                break
            i += 1
        return super().parse_args(ctx, args)


def _option_consumes_next(arg: str, ours: set[str], takes_value: set[str]) -> int:
    """1 if option ``arg`` (``--opt``, ``--opt=v``, ``-o``, ``-ov``, a cluster such as ``-iu``)
    takes the next argument as its value, else 0; an option that is not ours is a typo (the
    command has not begun), not an argument of the command."""
    if arg.startswith("--"):
        name, has_value = arg.split("=", 1)[0], "=" in arg
        names = [name]
    else:  # short options, clustered as click reads them: flags, then at most one with a value
        names, has_value = [], False
        for j, c in enumerate(arg[1:], start=1):
            names.append("-" + c)
            if "-" + c in takes_value:
                has_value = j < len(arg) - 1  # -eA=1: the value is attached
                break
    for name in names:
        if name not in ours:
            raise UnknownOption(f"no such option: {name} (the command's own options go after its first word, "
                                "or after --)")
    return int(names[-1] in takes_value and not has_value)


# Exit statuses of `aenv exec` that are not the command's, so that a script can tell them
# apart from its codes: as timeout(1) for a command killed at --timeout (CommandTimedOut:
# 124), as `docker run` for aenv's own failures (sandbox not found, server unreachable, the
# stream lost) and for a command that could not be started (CommandNotStarted: 126, 127).
EXIT_AENV_FAILED = 125


class UnknownOption(CliError):
    """An option of aenv exec's that it does not have: a usage error."""

    exit_code = 2


def stream_exec(client: ApiClient, sandbox_id: str, cmd: str | list[str], *, envs: dict[str, str] | None = None,
                cwd: str | None = None, user: str | None = None, timeout: float = 0) -> int:
    """Run ``cmd`` (a shell string or an argv list), copy its output, return its exit code."""
    body: dict[str, Any] = {"cmd": cmd, "stream": True, "timeout": timeout}
    if envs:
        body["envs"] = envs
    if cwd:
        body["cwd"] = cwd
    if user:
        body["user"] = user
    with client.stream("POST", f"/sandboxes/{sandbox_id}/exec", json=body, timeout=EXEC_TIMEOUT) as resp:
        for line in resp.iter_lines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                raise CliError(f"the server's output stream is not NDJSON (a proxy in between?): "
                               f"{line[:120]!r}") from None
            kind = event.get("type")
            if kind in ("stdout", "pty"):
                _write(sys.stdout, event.get("data", ""))
            elif kind == "stderr":
                _write(sys.stderr, event.get("data", ""))
            elif kind == "end":
                return _exit_code(event)
            # ("keepalive" lines only keep the read timeout from firing on a silent command)
            elif kind == "error":  # the stream failed after its start (agent lost, deadline)
                message = str(event.get("message") or "the command failed")
                if event.get("code") == "deadline_exceeded":
                    raise CommandTimedOut(f"the command ran longer than its timeout and was killed ({message})")
                if event.get("code") == "invalid_argument":
                    raise CommandNotStarted(message)
                raise CliError(message)
    raise CliError("the server closed the output stream before the command ended")


def _write(stream: Any, data: str) -> None:
    """The command's bytes as it wrote them: the server sends bytes that are not UTF-8 as
    lone surrogates (surrogateescape), and they go out as those bytes again."""
    raw = getattr(stream, "buffer", None)
    if raw is None:  # a text-only stream (tests capturing output)
        stream.write(data)
        stream.flush()
        return
    stream.flush()  # what went through the text layer first
    raw.write(data.encode("utf-8", "surrogateescape"))
    raw.flush()


def _exit_code(end: dict[str, Any]) -> int:
    """The command's exit status; a signal death becomes 128+N and is reported on stderr."""
    code = end.get("exitCode")
    error = end.get("error") or ""
    if not (isinstance(code, int) and code >= 0) and error:
        _write(sys.stderr, f"aenv: {error}\n")
    return exit_status(code if isinstance(code, int) else None, error)


def exec_command(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID", help="Sandbox id.", show_default=False)],
    cmd: Annotated[list[str], typer.Argument(metavar="CMD", show_default=False,
                                             help="One argument runs as a bash -l -c string; "
                                                  "several run as an argv list.")],
    env: Annotated[list[str] | None, typer.Option("--env", "-e", metavar="K=V",
                                                  help="Environment variable (repeatable).")] = None,
    cwd: Annotated[str | None, typer.Option("--cwd", help="Working directory in the sandbox.")] = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="User to run as (default: user).")] = None,
    timeout: Annotated[float, typer.Option("--timeout", "-t", help="Seconds before the command is "
                                                                   "killed; 0 means no limit.")] = 0,
    stdin: Annotated[bool, typer.Option("--stdin", "-i", help="Send this terminal's stdin to the command "
                                                              "(until EOF); without it the command's "
                                                              "stdin is empty.")] = False,
) -> None:
    """Run a command in a sandbox: `aenv exec ID -- CMD...`; exits with the command's code
    (128+N if signal N killed it), 124 if --timeout killed it, 125 if aenv itself failed, 126
    if the command could not be run, 127 if there is no such command."""
    envs = parse_pairs(env, "--env")
    command: str | list[str] = cmd[0] if len(cmd) == 1 else list(cmd)
    try:
        with client_for(ctx) as client:
            if stdin:  # straight to the sandbox's envd (through the server's proxy), which takes input
                sandbox = client.call("GET", f"/sandboxes/{sandbox_id}")
                if sandbox.get("state") != "running":
                    raise CliError(f"sandbox {sandbox_id} is {sandbox.get('state')}; it must be running "
                                   f"(`aenv resume {sandbox_id}`)", status=409)
                code = run_piped(client.url, sandbox, command, envs=envs, cwd=cwd, user=user, timeout=timeout)
            else:
                code = stream_exec(client, sandbox_id, command, envs=envs, cwd=cwd, user=user, timeout=timeout)
    except (CliError, AgentenvError, OSError) as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        message = exc.message if isinstance(exc, AgentenvError) else str(exc)
        sys.stderr.write(f"error: {message}\n")
        raise typer.Exit(exc.exit_code if isinstance(exc, (CommandTimedOut, CommandNotStarted))
                         else EXIT_AENV_FAILED) from None
    raise typer.Exit(code)
