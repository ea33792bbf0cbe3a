"""The undo stack of multi-step operations (orchestrator/cleanup.py)."""

from __future__ import annotations

from agentenv.orchestrator.cleanup import Cleanup


async def test_a_resource_released_on_the_normal_path_is_not_undone_again() -> None:
    """A template snapshot released its network slot, then failed (a full disk while keeping
    its memory): the unwind released the slot a second time, freeing an index another sandbox
    held by then. ``done`` takes a resource off the stack before its normal release."""
    calls: list[str] = []

    def undo(name: str):
        async def run() -> None:
            calls.append(name)
        return run

    stack = Cleanup("test")
    for name in ("dir", "slot", "machine"):
        stack.add(name, undo(name))
    stack.done("machine")
    stack.done("slot")
    await stack.unwind()
    assert calls == ["dir"]
