"""Creates under an Idempotency-Key, without VMs: the records are a plain list standing in for
the orchestrator's (the end-to-end test in tests/e2e/test_lifecycle.py uses the real server)."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentenv.errors import IdempotencyKeyReused, InvalidRequest
from agentenv.orchestrator.idempotency import OPTION, CreateOnce
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.store import SandboxRecord


def _record(sid: str, options: dict) -> SandboxRecord:
    return SandboxRecord(id=sid, template="base", state=State.RUNNING, vcpus=1, memory_mb=512, disk_mb=4096,
                         started_at=time.time(), end_at=time.time() + 60, access_token="t", run_dir="/x",
                         metadata={}, env_vars={}, slot_index=1, options=options)


async def test_concurrent_retries_get_the_one_sandbox_and_a_changed_request_is_refused() -> None:
    records: list[SandboxRecord] = []
    once = CreateOnce(lambda: records)
    made = 0

    async def make(option: dict[str, str]) -> SandboxRecord:
        nonlocal made
        made += 1
        await asyncio.sleep(0.05)  # a create takes a while; retries arrive meanwhile
        rec = _record(f"i{made}", {OPTION: option})
        records.append(rec)
        return rec

    results = await asyncio.gather(*(once.create("k1", "fp", make) for _ in range(5)))
    assert made == 1 and {r.id for r, _ in results} == {"i1"}
    assert sorted(replayed for _, replayed in results) == [False, True, True, True, True]
    with pytest.raises(IdempotencyKeyReused):
        await once.create("k1", "other request", make)
    (rec, replayed), = [await once.create("k2", "fp", make)]
    assert (rec.id, replayed, made) == ("i2", False, 2)
    records[0] = records[0].with_(state=State.ERROR)  # the sandbox failed: the key makes a new one
    assert (await once.create("k1", "fp", make))[0].id == "i3"
    with pytest.raises(InvalidRequest):
        await once.create("", "fp", make)


async def test_a_failed_first_attempt_lets_the_retry_create() -> None:
    records: list[SandboxRecord] = []
    once = CreateOnce(lambda: records)
    calls = 0

    async def make(option: dict[str, str]) -> SandboxRecord:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02)
        if calls == 1:
            raise RuntimeError("the node was full")
        rec = _record("iok", {OPTION: option})
        records.append(rec)
        return rec

    first, second = await asyncio.gather(once.create("k", "fp", make), once.create("k", "fp", make),
                                         return_exceptions=True)
    assert isinstance(first, RuntimeError)
    assert second == (records[0], False) and calls == 2


async def test_a_retried_fork_gets_the_children_still_alive_and_a_create_may_not_reuse_its_key() -> None:
    records: list[SandboxRecord] = []
    once = CreateOnce(lambda: records)
    forks = 0

    async def make(option: dict[str, str]) -> list[SandboxRecord]:
        nonlocal forks
        forks += 1
        await asyncio.sleep(0.05)  # a fork takes a while; the retry arrives meanwhile
        kids = [_record(f"c{forks}-{i}", {OPTION: option}) for i in range(3)]
        records.extend(kids)
        return kids

    (first_found, first_made), (again_found, again_made) = await asyncio.gather(
        once.fork("f", "fp", make), once.fork("f", "fp", make))
    assert forks == 1 and first_found == [] and again_made is None
    assert first_made == again_found == records
    records[1] = records[1].with_(state=State.KILLING)
    found, made = await once.fork("f", "fp", make)
    assert made is None and [r.id for r in found] == ["c1-0", "c1-2"]
    with pytest.raises(IdempotencyKeyReused, match="different create request"):
        await once.create("f", "a create's fingerprint", make)  # type: ignore[arg-type]
    with pytest.raises(IdempotencyKeyReused, match="different fork request"):
        await once.fork("f", "count 4", make)
