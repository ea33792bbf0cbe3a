"""``LiveSandbox.settled``: several waiters for the freeing of a paused sandbox's VM (a resume,
a kill, an eviction for memory). Pure asyncio: the freeing is a plain task here, which is what
the orchestrator hands it (orchestrator/parking.py)."""

from __future__ import annotations

import asyncio

from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.orchestrator.store import SandboxRecord


def _live() -> LiveSandbox:
    rec = SandboxRecord(id="s1", template="base", state=State.PAUSED, vcpus=1, memory_mb=512, disk_mb=1024,
                        started_at=0.0, end_at=0.0, access_token="t", run_dir="/nonexistent")
    return LiveSandbox(rec)


def test_every_waiter_waits_for_the_freeing_and_a_cancelled_one_does_not_cancel_it() -> None:
    async def main() -> None:
        live = _live()
        gate = asyncio.Event()
        freed: list[bool] = []

        async def free() -> None:
            await gate.wait()
            freed.append(True)

        live.releasing = asyncio.create_task(free())
        first = asyncio.create_task(live.settled())  # e.g. an eviction for memory
        second = asyncio.create_task(live.settled())  # e.g. the resume that follows
        cancelled = asyncio.create_task(live.settled())  # e.g. a create request that went away
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        assert not first.done() and not second.done(), "nobody returns before the VM is freed"
        assert not live.releasing.done(), "a cancelled waiter must not cancel the freeing"
        gate.set()
        await asyncio.gather(first, second)
        assert freed == [True]
        assert live.releasing is None

    asyncio.run(main())


def test_a_failed_freeing_is_logged_not_raised() -> None:
    async def main() -> None:
        live = _live()

        async def fail() -> None:
            raise OSError("kill failed")

        live.releasing = asyncio.create_task(fail())
        await live.settled()
        await live.settled()
        assert live.releasing is None

    asyncio.run(main())
