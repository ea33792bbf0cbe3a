"""Host commands run from async code leave nothing behind when their caller is cancelled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentenv.proc import run


def _running(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def test_a_cancelled_command_is_killed_and_reaped() -> None:
    marker = "31.4159"  # an argument no other process has

    async def cancel_it() -> None:
        task = asyncio.create_task(run(["sleep", marker]))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if _running(marker):
                break
        assert _running(marker), "the command started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_it())
    assert _running(marker) == []
