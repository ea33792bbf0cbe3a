"""Background gc requests are coalesced (orchestrator/coalesce.py): a burst of kills makes one
or two collections, not one each, and no request goes without a run that starts after it."""

from __future__ import annotations

import asyncio

from agentenv.orchestrator.coalesce import Coalesced


async def test_a_burst_of_requests_makes_one_more_run_and_none_is_lost() -> None:
    runs: list[int] = []  # what each run saw: the requests made before it started
    requested = 0
    tasks: set[asyncio.Task[object]] = set()

    async def job() -> None:
        runs.append(requested)
        await asyncio.sleep(0.05)  # a collection takes a while; requests arrive meanwhile

    def start(work):
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        return task

    gc = Coalesced(job, start)
    for _ in range(1000):  # a training step ends: its rollouts are killed at once
        requested += 1
        gc.request()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert len(runs) <= 2 and runs[-1] == 1000, runs  # the last run started after the last request
    done = len(runs)
    requested += 1
    gc.request()  # after all that: a run of its own
    await asyncio.gather(*tasks)
    assert len(runs) == done + 1 and runs[-1] == requested


async def test_a_run_that_fails_still_gives_the_requests_made_meanwhile_their_run() -> None:
    runs = 0
    tasks: set[asyncio.Task[object]] = set()

    async def job() -> None:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.02)
        if runs == 1:
            raise OSError("a manifest could not be read")

    def start(work):
        task = asyncio.get_running_loop().create_task(work)
        tasks.add(task)
        return task

    gc = Coalesced(job, start)
    gc.request()
    await asyncio.sleep(0.01)  # the first run is under way
    gc.request()
    await asyncio.gather(*tasks)
    assert runs == 2
