"""Build records and built templates, one JSON file each under ``<data>/builds/``.

    <data>/builds/<buildID>.json              a build: status, log entries, reason, its spec
    <data>/builds/templates/<templateID>.json a built template: its current build and checkpoint

Files are replaced atomically (temp + rename), so a crash leaves the old or the new version.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.durable import publish

log = logging.getLogger(__name__)

LEVELS = ("debug", "info", "warn", "error")
ACTIVE = ("waiting", "building")


@dataclass
class LogEntry:
    timestamp: float
    message: str
    level: str = "info"
    step: str | None = None


@dataclass
class BuildRecord:
    build_id: str
    template_id: str
    status: str = "waiting"  # waiting | building | ready | error
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    vcpus: int | None = None
    memory_mb: int | None = None
    tags: list[str] = field(default_factory=list)
    spec: dict[str, Any] | None = None
    reason: dict[str, Any] | None = None  # {message, step?}
    sandbox_id: str | None = None  # the build's temporary sandbox while it runs
    cache: list[str] = field(default_factory=list)  # build-step checkpoint ids this build made or used
    logs: list[LogEntry] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BuildRecord:
        d = dict(d)
        d["logs"] = [LogEntry(**x) for x in d.get("logs") or []]
        return cls(**d)


@dataclass
class TemplateEntry:
    """A built template: its name is its id; ``checkpoint`` is what sandboxes start from."""

    template_id: str
    build_id: str
    checkpoint: str
    vcpus: int
    memory_mb: int
    disk_mb: int
    created_at: float
    updated_at: float
    build_count: int = 1
    start_cmd: str | None = None
    ready_cmd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    cache: list[str] = field(default_factory=list)  # build-step checkpoints its build used
    final_key: str | None = None  # base + every step + start/ready: an identical rebuild reuses it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TemplateEntry:
        return cls(**d)


def _write(path: Path, data: dict[str, Any], durable: bool = False) -> None:
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    if durable:
        publish(tmp, path)
    else:
        os.replace(tmp, path)


class BuildFiles:
    """The records on disk. Blocking, small files; callers use it off the event loop or
    accept a few ms."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.templates_dir = root / "templates"
        self.templates_dir.mkdir(parents=True, exist_ok=True)

    def put_build(self, b: BuildRecord) -> None:
        _write(self.root / f"{b.build_id}.json", b.to_json())

    def builds(self) -> list[BuildRecord]:
        out = []
        for p in self.root.glob("*.json"):
            try:
                out.append(BuildRecord.from_json(json.loads(p.read_text())))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("unreadable build record %s skipped (%s)", p, exc)
        return sorted(out, key=lambda b: b.created_at)

    def delete_build(self, build_id: str) -> None:
        (self.root / f"{build_id}.json").unlink(missing_ok=True)

    def put_template(self, t: TemplateEntry) -> None:
        _write(self.templates_dir / f"{t.template_id}.json", t.to_json(), durable=True)  # names a durable checkpoint

    def templates(self) -> list[TemplateEntry]:
        out = []
        for p in self.templates_dir.glob("*.json"):
            try:
                out.append(TemplateEntry.from_json(json.loads(p.read_text())))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("unreadable template record %s skipped (%s)", p, exc)
        return sorted(out, key=lambda t: t.created_at)

    def delete_template(self, template_id: str) -> None:
        (self.templates_dir / f"{template_id}.json").unlink(missing_ok=True)
