"""The sandbox store: SQLite in the data dir (the embedded single-node default).

All calls run on a worker thread (``asyncio.to_thread``) so the event loop never waits on disk.
WAL mode keeps writers from blocking readers; ``synchronous=NORMAL`` is durable across a
process crash, which is the failure the store must survive (a server restart loses nothing).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentenv.errors import DiskFull, StorageError
from agentenv.orchestrator.lifecycle import State
from agentenv.storage.repository import Checkpoint

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template TEXT NOT NULL,
    state TEXT NOT NULL,
    vcpus INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    slot_index INTEGER,
    access_token TEXT NOT NULL,
    error TEXT,
    run_dir TEXT NOT NULL,
    options TEXT NOT NULL DEFAULT '{}'
);
"""

# Columns added after the first release; added to older databases on open.
_ADDED = {
    "options": "TEXT NOT NULL DEFAULT '{}'",
    "base_dir": "TEXT NOT NULL DEFAULT ''",
    "disk_path": "TEXT NOT NULL DEFAULT ''",
    "origin": "TEXT",
    "paused": "TEXT",
    "auto_pause": "INTEGER NOT NULL DEFAULT 0",
    "timeout_s": "INTEGER NOT NULL DEFAULT 300",
}


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    template: str
    state: State
    vcpus: int
    memory_mb: int
    disk_mb: int
    started_at: float
    end_at: float
    access_token: str
    run_dir: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    slot_index: int | None = None
    error: str | None = None
    base_dir: str = ""  # the template snapshot whose memory file the RAM maps
    disk_path: str = ""  # the qcow2 overlay the sandbox writes to now
    origin: Checkpoint | None = None  # the checkpoint it was restored from (its layers stay pinned)
    paused: Checkpoint | None = None  # its saved state while paused
    auto_pause: bool = False  # at timeout: pause instead of kill
    timeout_s: int = 300  # the timeout it was given (forks restart it)

    def pins(self) -> set[str]:
        """Repository layers this sandbox needs."""
        out: set[str] = set()
        for cp in (self.origin, self.paused):
            if cp is not None:
                out |= cp.layer_names()
        return out
    # E2B create options kept for the sandbox's life (JSON): "network" (allowOut, denyOut,
    # allowPublicTraffic, maskRequestHost), "trafficAccessToken", "autoPause",
    # "autoPauseMemory", "autoResume", "secure", "mcp".
    options: dict[str, Any] = field(default_factory=dict)

    def with_(self, **changes: object) -> SandboxRecord:
        return replace(self, **changes)  # type: ignore[arg-type]


_COLS = ("id", "template", "state", "vcpus", "memory_mb", "disk_mb", "started_at", "end_at",
         "metadata", "env_vars", "slot_index", "access_token", "error", "run_dir", *_ADDED)


def _cp_json(cp: Checkpoint | None) -> str | None:
    return None if cp is None else json.dumps(cp.to_json())


def _cp(text: str | None) -> Checkpoint | None:
    return None if not text else Checkpoint.from_json(json.loads(text))


def _to_row(r: SandboxRecord) -> tuple[object, ...]:
    return (r.id, r.template, r.state.value, r.vcpus, r.memory_mb, r.disk_mb, r.started_at, r.end_at,
            json.dumps(r.metadata), json.dumps(r.env_vars), r.slot_index, r.access_token, r.error, r.run_dir,
            json.dumps(r.options),
            r.base_dir, r.disk_path, _cp_json(r.origin), _cp_json(r.paused), int(r.auto_pause), r.timeout_s)


def _from_row(row: sqlite3.Row) -> SandboxRecord:
    return SandboxRecord(
        id=row["id"], template=row["template"], state=State(row["state"]), vcpus=row["vcpus"],
        memory_mb=row["memory_mb"], disk_mb=row["disk_mb"], started_at=row["started_at"],
        end_at=row["end_at"], metadata=json.loads(row["metadata"]), env_vars=json.loads(row["env_vars"]),
        slot_index=row["slot_index"], access_token=row["access_token"], error=row["error"],
        run_dir=row["run_dir"], base_dir=row["base_dir"], disk_path=row["disk_path"],
        origin=_cp(row["origin"]), paused=_cp(row["paused"]), auto_pause=bool(row["auto_pause"]),
        timeout_s=row["timeout_s"],
        options=json.loads(row["options"] or "{}"),
    )


class Store:
    """Persisted sandbox records. One connection, serialised by a lock, used off-loop."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        for col, decl in _ADDED.items():
            if col not in have:
                self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {col} {decl}")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[object, ...] = ()) -> list[sqlite3.Row]:
        """Raises StorageError (DiskFull when SQLite says so): a write that failed was not
        recorded, and callers keep the sandbox in the state the store still has."""
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                full = isinstance(exc, sqlite3.OperationalError) and "full" in str(exc)
                raise (DiskFull if full else StorageError)(
                    f"the sandbox store ({self.path}) failed: {exc}; the operation did not take effect "
                    f"(check the data dir's disk)") from exc

    async def put(self, r: SandboxRecord) -> None:
        sql = f"INSERT OR REPLACE INTO sandboxes ({','.join(_COLS)}) VALUES ({','.join('?' * len(_COLS))})"
        await asyncio.to_thread(self._exec, sql, _to_row(r))

    async def delete(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self._exec, "DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    async def all(self) -> list[SandboxRecord]:
        rows = await asyncio.to_thread(self._exec, "SELECT * FROM sandboxes ORDER BY started_at DESC")
        return [_from_row(r) for r in rows]
