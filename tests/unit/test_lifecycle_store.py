"""The lifecycle table and the SQLite store, without VMs."""

from __future__ import annotations

import time
from pathlib import Path

from agentenv.bench.stats import summarize
from agentenv.orchestrator.ids import is_sandbox_id, new_api_key, new_sandbox_id
from agentenv.orchestrator.lifecycle import State, allowed
from agentenv.orchestrator.store import SandboxRecord, Store


def test_transitions() -> None:
    assert allowed(State.CREATING, State.RUNNING)
    assert allowed(State.RUNNING, State.ERROR)
    assert not allowed(State.ERROR, State.RUNNING)
    assert not allowed(State.KILLING, State.RUNNING)


def test_ids_fit_host_names_and_keys_fit_e2b() -> None:
    ids = {new_sandbox_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_sandbox_id(i) and len(i) == 20 and "-" not in i and "." not in i for i in ids)
    key = new_api_key()
    assert key.startswith("e2b_") and len(key) == 44 and int(key[4:], 16) >= 0


async def test_store_roundtrip_survives_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    rec = SandboxRecord(id="iabc", template="base", state=State.RUNNING, vcpus=1, memory_mb=512, disk_mb=4096,
                        started_at=time.time(), end_at=time.time() + 60, access_token="t", run_dir="/x",
                        metadata={"k": "v"}, env_vars={"A": "1"}, slot_index=3)
    await store.put(rec)
    await store.put(rec.with_(state=State.ERROR, error="boom", slot_index=None))
    store.close()
    again = Store(tmp_path / "s.sqlite")
    (got,) = await again.all()
    assert got == rec.with_(state=State.ERROR, error="boom", slot_index=None)
    await again.delete("iabc")
    assert await again.all() == []


def test_summarize() -> None:
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"min": 1.0, "median": 3.0, "p99": 5.0, "runs": 5}
    big = summarize([float(i) for i in range(1, 201)])
    assert big["p99"] == 198.0
