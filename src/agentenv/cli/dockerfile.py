"""The build file of ``aenv template build`` (``aenv.Dockerfile``): a Dockerfile subset plus
two lines for the start and ready commands, turned into E2B's build request (steps).

    # comment
    FROM base                      a template name, or an image reference (has '/', ':' or '.')
    RUN apt-get update && \\
        apt-get install -y jq      (a trailing backslash continues the line)
    RUN --user=root cmd            run one step as another user
    ENV KEY=value OTHER="two words"    or    ENV KEY value
    WORKDIR /app
    USER user
    COPY [--chown=user[:group]] [--chmod=0755] src... dest   (paths in the context directory)
    START_CMD python3 -m http.server 8000    runs when the build ends; keeps running in sandboxes
    READY_CMD curl -sf http://127.0.0.1:8000/  the build waits until it exits 0

``CMD``/``ENTRYPOINT`` are read as START_CMD (shell form or JSON exec form).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO


class BuildFileError(ValueError):
    """A line of the build file is wrong; the message names the line."""


@dataclass
class Copy:
    step: int  # index in steps
    sources: list[str]


@dataclass
class BuildFile:
    body: dict[str, Any]  # TemplateBuildStartV2 without filesHash (added once hashed)
    copies: list[Copy] = field(default_factory=list)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comments inside a continued instruction, as Docker allows
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        out.append((start, buf.strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def _env_pairs(n: int, rest: str) -> list[str]:
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise BuildFileError(f"line {n}: ENV: {exc}") from None
    if words and "=" not in words[0]:
        if len(words) < 2:
            raise BuildFileError(f"line {n}: ENV needs KEY=value or KEY value")
        return [words[0], rest.split(None, 1)[1].strip()]  # ENV KEY the rest of the line
    args: list[str] = []
    for w in words:
        k, sep, v = w.partition("=")
        if not sep or not k:
            raise BuildFileError(f"line {n}: ENV: {w!r} is not KEY=value")
        args += [k, v]
    if not args:
        raise BuildFileError(f"line {n}: ENV needs KEY=value")
    return args


def _flags(n: int, instr: str, rest: str, allowed: tuple[str, ...]) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        rest = rest.lstrip()
        name, sep, value = word[2:].partition("=")
        if name not in allowed or not sep or not value:
            raise BuildFileError(f"line {n}: {instr}: unknown flag {word!r} (allowed: "
                                 f"{', '.join('--' + a + '=...' for a in allowed)})")
        flags[name] = value
    return flags, rest


def _command(rest: str) -> str:
    """Shell form as is; JSON exec form (``["a", "b"]``) quoted into one shell command."""
    if rest.startswith("["):
        try:
            argv = json.loads(rest)
        except ValueError:
            return rest
        if isinstance(argv, list) and all(isinstance(a, str) for a in argv):
            return shlex.join(argv)
    return rest


def parse(text: str) -> BuildFile:
    body: dict[str, Any] = {"steps": []}
    steps: list[dict[str, Any]] = body["steps"]
    copies: list[Copy] = []
    seen_from = False
    for n, line in _logical_lines(text):
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr != "FROM" and not seen_from:
            raise BuildFileError(f"line {n}: the file must start with FROM <template or image>")
        if instr in ("FROM", "RUN", "WORKDIR", "USER", "COPY", "START_CMD", "READY_CMD", "CMD", "ENTRYPOINT",
                     "ENV") and not rest:
            raise BuildFileError(f"line {n}: {instr} needs an argument")
        if instr == "FROM":
            if seen_from:
                raise BuildFileError(f"line {n}: only one FROM is supported (no multi-stage builds)")
            seen_from = True
            ref = rest.split()[0]
            if " AS " in f" {rest.upper()} ":
                raise BuildFileError(f"line {n}: FROM ... AS (multi-stage builds) is not supported")
            body["fromImage" if re.search(r"[/:.@]", ref) else "fromTemplate"] = ref
        elif instr == "RUN":
            flags, rest = _flags(n, instr, rest, ("user",))
            steps.append({"type": "RUN", "args": [_command(rest), *([flags["user"]] if "user" in flags else [])]})
        elif instr == "ENV":
            steps.append({"type": "ENV", "args": _env_pairs(n, rest)})
        elif instr in ("WORKDIR", "USER"):
            steps.append({"type": instr, "args": [rest]})
        elif instr in ("COPY", "ADD"):
            if instr == "ADD":
                raise BuildFileError(f"line {n}: ADD is not supported; use COPY (and RUN curl for URLs)")
            flags, rest = _flags(n, instr, rest, ("chown", "chmod"))
            try:
                words = shlex.split(rest)
            except ValueError as exc:
                raise BuildFileError(f"line {n}: COPY: {exc}") from None
            if len(words) < 2:
                raise BuildFileError(f"line {n}: COPY needs a source and a destination")
            *sources, dest = words
            for src in sources:
                if src.startswith("/") or ".." in Path(src).parts:
                    raise BuildFileError(f"line {n}: COPY source {src!r} must be inside the context directory")
            if len(sources) > 1 and not dest.endswith("/"):
                dest += "/"  # several sources go into a directory, as in Docker
            mode = flags.get("chmod", "")
            if mode and not re.fullmatch(r"0?[0-7]{3,4}", mode):
                raise BuildFileError(f"line {n}: --chmod={mode} must be octal, e.g. 0755")
            for src in sources:
                copies.append(Copy(len(steps), [src]))
                steps.append({"type": "COPY", "args": [src, dest, flags.get("chown", ""), mode]})
        elif instr in ("START_CMD", "CMD", "ENTRYPOINT"):
            body["startCmd"] = _command(rest)
        elif instr == "READY_CMD":
            body["readyCmd"] = _command(rest)
        elif instr in ("EXPOSE", "LABEL", "ARG", "SHELL", "HEALTHCHECK", "VOLUME", "STOPSIGNAL", "ONBUILD"):
            raise BuildFileError(f"line {n}: {instr} is not supported in aenv build files")
        else:
            raise BuildFileError(f"line {n}: unknown instruction {instr!r}")
    if not seen_from:
        raise BuildFileError("the build file has no FROM line")
    return BuildFile(body, copies)


def _matches(context: Path, src: str) -> list[Path]:
    paths = sorted(Path(p) for p in glob.glob(src, root_dir=context, recursive=True))
    if not paths:
        raise BuildFileError(f"COPY {src}: nothing in {context} matches it")
    out: list[Path] = []
    for p in paths:
        out.append(p)
        full = context / p
        if full.is_dir() and not full.is_symlink():
            for root, dirs, files in os.walk(full):
                dirs.sort()
                rel = Path(root).relative_to(context)
                out += [rel / d for d in dirs] + [rel / f for f in sorted(files)]
    return out


def files_hash(context: Path, src: str, dest: str) -> str:
    """sha256 over the COPY's arguments and every matched path's name, mode and content."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    for p in _matches(context, src):
        full = context / p
        st = full.lstat()
        h.update(f"\0{p.as_posix()}\0{st.st_mode:o}\0".encode())
        if full.is_symlink():
            h.update(os.readlink(full).encode())
        elif full.is_file():
            with open(full, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def tar_gz(context: Path, src: str, out: BinaryIO) -> None:
    """The matched files, named relative to the context (what the E2B SDK uploads), written
    to ``out`` (a temporary file: a context may hold GiBs, which must not sit in memory)."""
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for p in _matches(context, src):
            tar.add(context / p, arcname=p.as_posix(), recursive=False)
