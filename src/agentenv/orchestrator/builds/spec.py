"""What a build asks for (E2B's TemplateBuildStartV2), checked, and the cache keys of its steps.

Steps: ``RUN [cmd, user?]``, ``ENV [k, v, k2, v2, ...]``, ``WORKDIR [path]``, ``USER [name]``,
``COPY [src, dest, user?, mode?]`` + ``filesHash``. ENV, WORKDIR and USER are pure
configuration (``Config``); RUN and COPY change the guest and get a cached checkpoint each.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any

from agentenv.errors import InvalidRequest

STEP_TYPES = ("RUN", "ENV", "WORKDIR", "USER", "COPY")
CHECKPOINTED = ("RUN", "COPY")  # steps that change the guest; the others fold into the next key
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
USER_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}(:[a-z_][a-z0-9_.-]{0,31})?|[0-9]{1,10}(:[0-9]{1,10})?")
FILES_HASH = re.compile(r"[A-Za-z0-9_-]{8,128}")
MODE = re.compile(r"0?[0-7]{3,4}")
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# E2B's default base image (the SDK sends it when no base is chosen): ours is E2B-compatible.
E2B_BASE_IMAGES = ("e2bdev/base", "docker.io/e2bdev/base")


@dataclass(frozen=True)
class Step:
    type: str
    args: tuple[str, ...]
    files_hash: str | None = None
    force: bool = False

    def describe(self, limit: int = 120) -> str:
        if self.type == "ENV":
            text = " ".join(f"{k}={v}" for k, v in zip(self.args[::2], self.args[1::2], strict=False))
        elif self.type == "COPY":
            text = " ".join(a for a in self.args[:2])
        else:
            text = self.args[0] if self.args else ""
        text = " ".join(text.split())
        if len(text) > limit:
            text = text[: limit - 1] + "…"
        return f"{self.type} {text}"

    def identity(self) -> dict[str, Any]:
        """What the step's result depends on (not ``force``)."""
        return {"type": self.type, "args": list(self.args), "filesHash": self.files_hash}


@dataclass(frozen=True)
class Config:
    """What ENV, WORKDIR and USER accumulate; RUN and COPY run with it; the template keeps it."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None

    def apply(self, step: Step) -> Config:
        if step.type == "ENV":
            env = dict(self.env)
            env.update(zip(step.args[::2], step.args[1::2], strict=False))
            return replace(self, env=env)
        if step.type == "WORKDIR":
            path = step.args[0]
            if not path.startswith("/"):
                path = posixpath.join(self.workdir or "/", path)
            return replace(self, workdir=posixpath.normpath(path))
        if step.type == "USER":
            return replace(self, user=step.args[0])
        return self


@dataclass(frozen=True)
class RegistryAuth:
    username: str
    password: str


@dataclass(frozen=True)
class BuildSpec:
    from_template: str | None
    from_image: str | None
    registry: RegistryAuth | None
    steps: tuple[Step, ...]
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False
    ready_timeout_s: float | None = None  # AgentENV extension (``readyTimeout``, seconds)

    def to_json(self) -> dict[str, Any]:
        """For the build record (registry credentials are never stored)."""
        out: dict[str, Any] = {
            "steps": [{**s.identity(), "force": s.force} for s in self.steps], "force": self.force}
        for k, v in (("fromTemplate", self.from_template), ("fromImage", self.from_image),
                     ("startCmd", self.start_cmd), ("readyCmd", self.ready_cmd),
                     ("readyTimeout", self.ready_timeout_s)):
            if v is not None:
                out[k] = v
        return out

    def configs(self) -> list[Config]:
        """The configuration in effect after each step."""
        out, c = [], Config()
        for s in self.steps:
            c = c.apply(s)
            out.append(c)
        return out

    def cache_keys(self, base_identity: Any) -> list[str]:
        """sha256 chain: key i names the state after steps 0..i on this base (ENV/WORKDIR/USER
        steps are in the chain, so they change the key of the next RUN or COPY)."""
        h = hashlib.sha256(json.dumps(["aenv-build-v1", base_identity], sort_keys=True).encode()).hexdigest()
        keys = []
        for s in self.steps:
            h = hashlib.sha256((h + json.dumps(s.identity(), sort_keys=True)).encode()).hexdigest()
            keys.append(h)
        return keys

    def reusable_until(self) -> int:
        """Steps before this index may come from the cache (``force`` invalidates from its step)."""
        if self.force:
            return 0
        for i, s in enumerate(self.steps):
            if s.force:
                return i
        return len(self.steps)


def _err(index: int, step: Any, what: str) -> InvalidRequest:
    kind = step.get("type") if isinstance(step, dict) else None
    return InvalidRequest(f"steps[{index}] (step {index + 1}{', ' + str(kind) if kind else ''}): {what}")


def _step(index: int, raw: Any) -> Step:
    if not isinstance(raw, dict):
        raise _err(index, raw, "must be an object {type, args, filesHash?, force?}")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind.upper() not in STEP_TYPES:
        raise _err(index, raw, f"type must be one of {', '.join(STEP_TYPES)}, got {kind!r}")
    kind = kind.upper()
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise _err(index, raw, "args must be a list of strings")
    force = raw.get("force") or False
    if not isinstance(force, bool):
        raise _err(index, raw, "force must be a boolean")
    files_hash = raw.get("filesHash")
    # Trailing empty optional arguments (E2B's COPY sends "" for no user / no mode).
    if kind == "RUN":
        if not 1 <= len(args) <= 2 or not args[0].strip():
            raise _err(index, raw, "args must be [command] or [command, user] with a non-empty command")
        if len(args) == 2 and args[1] and not USER_RE.fullmatch(args[1]):
            raise _err(index, raw, f"user {args[1]!r} is not a valid user name")
        args = args if len(args) == 1 or args[1] else args[:1]
    elif kind == "ENV":
        if not args or len(args) % 2:
            raise _err(index, raw, "args must be [key, value, ...] (an even number of strings)")
        for k in args[::2]:
            if not ENV_KEY.fullmatch(k):
                raise _err(index, raw, f"{k!r} is not a valid environment variable name")
    elif kind == "WORKDIR":
        if len(args) != 1 or not args[0].strip():
            raise _err(index, raw, "args must be [path]")
    elif kind == "USER":
        if len(args) != 1 or not USER_RE.fullmatch(args[0]):
            raise _err(index, raw, f"args must be [user name], got {args!r}")
    elif kind == "COPY":
        if not 2 <= len(args) <= 4 or not args[0].strip() or not args[1].strip():
            raise _err(index, raw, "args must be [src, dest, user?, mode?]")
        if len(args) > 2 and args[2] and not USER_RE.fullmatch(args[2]):
            raise _err(index, raw, f"owner {args[2]!r} is not a valid user[:group]")
        if len(args) > 3 and args[3] and not MODE.fullmatch(args[3]):
            raise _err(index, raw, f"mode {args[3]!r} must be octal, e.g. 0755")
        if ".." in args[0].split("/") or args[0].startswith("/"):
            raise _err(index, raw, f"src {args[0]!r} must be a path inside the build context")
        if not isinstance(files_hash, str) or not FILES_HASH.fullmatch(files_hash):
            raise _err(index, raw, "filesHash is required for COPY (the hash the files were uploaded under)")
        args = list(args) + [""] * (4 - len(args))
    if kind != "COPY":
        files_hash = None
    return Step(kind, tuple(args), files_hash, force)


def parse_spec(body: dict[str, Any]) -> BuildSpec:
    """Check a TemplateBuildStartV2 body; errors name the field or step and what is wrong."""
    if not isinstance(body, dict):
        raise InvalidRequest("the build body must be a JSON object")
    from_template, from_image = body.get("fromTemplate"), body.get("fromImage")
    for name, v in (("fromTemplate", from_template), ("fromImage", from_image)):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise InvalidRequest(f"{name} must be a non-empty string")
    if from_template and from_image:
        raise InvalidRequest("give either fromTemplate or fromImage, not both")
    if not from_template and not from_image:
        raise InvalidRequest("fromTemplate (a template name) or fromImage (an image reference) is required")
    registry = None
    reg = body.get("fromImageRegistry")
    if reg is not None:
        if not from_image:
            raise InvalidRequest("fromImageRegistry needs fromImage")
        if not isinstance(reg, dict) or reg.get("type", "registry") != "registry":
            raise InvalidRequest("fromImageRegistry: only {type: registry, username, password} is supported "
                                 "(no AWS or GCP registries)")
        if not reg.get("username") or not reg.get("password"):
            raise InvalidRequest("fromImageRegistry needs both username and password")
        registry = RegistryAuth(str(reg["username"]), str(reg["password"]))
    if from_image and from_image.split(":")[0].split("@")[0] in E2B_BASE_IMAGES:
        from_template, from_image = "base", None
    raw_steps = body.get("steps") or []
    if not isinstance(raw_steps, list):
        raise InvalidRequest("steps must be a list")
    steps = tuple(_step(i, s) for i, s in enumerate(raw_steps))
    cmds: dict[str, str | None] = {}
    for name in ("startCmd", "readyCmd"):
        v = body.get(name)
        if v is not None and not isinstance(v, str):
            raise InvalidRequest(f"{name} must be a string")
        cmds[name] = v if v and v.strip() else None
    force = body.get("force") or False
    if not isinstance(force, bool):
        raise InvalidRequest("force must be a boolean")
    ready_timeout = body.get("readyTimeout")
    if ready_timeout is not None and (not isinstance(ready_timeout, int | float) or not 0 < ready_timeout <= 3600):
        raise InvalidRequest("readyTimeout must be a number of seconds between 0 and 3600")
    return BuildSpec(from_template=from_template, from_image=from_image, registry=registry, steps=steps,
                     start_cmd=cmds["startCmd"], ready_cmd=cmds["readyCmd"], force=force,
                     ready_timeout_s=float(ready_timeout) if ready_timeout is not None else None)


def split_name(name: str) -> tuple[str, list[str]]:
    """``name`` or ``name:tag`` → (name, tags); the name checked."""
    if not isinstance(name, str):
        raise InvalidRequest("name must be a string")
    base, _, tag = name.partition(":")
    if not TEMPLATE_NAME.fullmatch(base):
        raise InvalidRequest(f"template name {base!r} must be 1-64 letters, digits, '-' or '_', starting with a "
                             "letter or digit")
    return base, [tag] if tag else []
