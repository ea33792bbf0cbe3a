"""Parked VMs: the stopped QEMU of a sandbox just paused, kept for a quick resume.

A pause saves the whole state (memory layer, device state, disk) before it answers, so the
stopped VM is no longer needed, and killing it frees its memory. But a resume then starts a
new QEMU, and under TCG a new QEMU starts with an empty translation cache: the guest's first
answer (kernel network path, the agent's Python) is translated again from nothing, which is
most of a cold resume (docs/benchmarks.md). So the stopped VM is kept for
``AENV_PAUSE_LINGER_S`` (60 s by default; 0 turns parking off): a resume within that time
continues the same QEMU (``cont``, then the guest is given the clock), one after it restores
from the saved state as before.

A parked VM uses no CPU; it holds the memory of an idle running sandbox, plus what the guest
dirtied. It is freed when its linger time ends, when the sandbox is killed, when the server
stops, and as soon as memory runs short: before a create, resume or fork would be refused
for memory (``Orchestrator.admit``), and, below the node's reserve, by the keeper here (oldest
first), before the warm pool gives back its shells. Nothing depends on it: the saved state is
complete, a parked VM that died is only noticed by the next resume, which then restores from
the saved state, and a server restart kills parked VMs (recovery, as any QEMU of a paused
sandbox).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from agentenv.envd_client import EnvdClient, EnvdError
from agentenv.errors import GuestError, VmmError
from agentenv.orchestrator.capacity import below_reserve
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox, Parked

if TYPE_CHECKING:
    from agentenv.network import Slot
    from agentenv.orchestrator.service import Orchestrator
    from agentenv.orchestrator.store import SandboxRecord
    from agentenv.storage import Checkpoint
    from agentenv.vmm import Machine

log = logging.getLogger(__name__)

KEEPER_INTERVAL_S = 1.0


async def free(orch: Orchestrator, machine: Machine, envd: EnvdClient | None, slot: Slot | None) -> None:
    """Kill a paused sandbox's VM and return its network slot."""
    try:
        await machine.kill()
        if envd:
            await envd.aclose()
    finally:
        if slot:
            await orch.slots.release(slot)


def free_later(orch: Orchestrator, live: LiveSandbox, machine: Machine, envd: EnvdClient | None,
               slot: Slot | None) -> None:
    """``free`` in the background; ``live.settled()`` waits for it (resume and kill do)."""
    live.releasing = asyncio.get_running_loop().create_task(free(orch, machine, envd, slot))


def park(orch: Orchestrator, live: LiveSandbox, machine: Machine, envd: EnvdClient, slot: Slot) -> None:
    """Keep the stopped VM of ``live`` (just paused) for ``pause_linger_s``."""
    p = Parked(machine, envd, slot, since=time.monotonic())
    p.expiry = asyncio.get_running_loop().call_later(
        orch.settings.pause_linger_s, lambda: evict(orch, live, p, "its linger time ended"))
    live.parked = p


def take(live: LiveSandbox) -> Parked | None:
    """Remove the parked VM from ``live`` (the caller now owns it)."""
    p, live.parked = live.parked, None
    if p is not None and p.expiry is not None:
        p.expiry.cancel()
    return p


def evict(orch: Orchestrator, live: LiveSandbox, p: Parked | None = None, why: str = "") -> bool:
    """Free the parked VM of ``live`` (``p``: only if it is still that one) in the background;
    ``live.settled()`` waits for it. False when there was none."""
    if live.parked is None or (p is not None and live.parked is not p):
        return False
    p = take(live)
    assert p is not None
    free_later(orch, live, p.machine, p.envd, p.slot)
    log.info("sandbox %s: its parked VM is freed (%s)", live.id, why)
    return True


def parked(orch: Orchestrator) -> list[LiveSandbox]:
    """Sandboxes with a parked VM, the longest parked first."""
    return sorted((live for live in orch._live.values() if live.parked is not None),
                  key=lambda live: live.parked.since if live.parked else 0.0)


async def evict_oldest(orch: Orchestrator, why: str) -> bool:
    """Free the longest-parked VM and wait until its memory is back. False when none is parked."""
    for live in parked(orch):
        if evict(orch, live, why=why):
            await live.settled()
            return True
    return False


async def keeper(orch: Orchestrator) -> None:
    """Below the node's memory reserve, free parked VMs one at a time (their state is saved;
    the running sandboxes need the memory)."""
    while True:
        await asyncio.sleep(KEEPER_INTERVAL_S)
        try:
            while parked(orch) and below_reserve(orch.settings.mem_reserve_mb):
                await evict_oldest(orch, "the host is below its memory reserve")
        except Exception:  # noqa: BLE001 — background
            log.exception("freeing parked VMs failed")


async def wake(orch: Orchestrator, live: LiveSandbox, cp: Checkpoint, timeout: int) -> SandboxRecord | None:
    """Resume ``live`` on its parked VM: continue it and give the guest the clock (it stood
    still while stopped). None when the VM cannot be continued: it is then freed, the sandbox
    is ``paused`` again, and the caller restores it from ``cp`` instead. Once the VM runs
    there is no going back to ``cp`` (its disk moves on), so a guest that does not answer
    then leaves the sandbox ``running`` and raises GuestError."""
    assert live.parked is not None
    # Taken from the parked list before it becomes the sandbox's machine: its memory file
    # (a fork's) is claimed meanwhile, or a gc would see no VM mapping it.
    with orch.claiming(live.parked.machine.spec.mem_path):
        return await _wake(orch, live, cp, timeout)


async def _wake(orch: Orchestrator, live: LiveSandbox, cp: Checkpoint, timeout: int) -> SandboxRecord | None:
    p = take(live)
    assert p is not None
    t0 = time.perf_counter()
    before = live.record
    recorded = False
    try:
        # With its slot recorded, recovery re-adopts this VM if the server dies during the wake,
        # with the time to live this resume gives it (the old one may be long past).
        await orch._transition(live, State.RESUMING, slot_index=p.slot.index, end_at=time.time() + timeout,
                               timeout_s=timeout)
        recorded = True
        await orch.checkpoints.crash_point("wake_before_cont")
        if p.machine.exited:
            raise VmmError("its QEMU exited while parked")
        await p.machine.qmp("cont")
    except BaseException as exc:  # the VM did not run: the saved state is the sandbox's state
        if recorded and isinstance(exc, asyncio.CancelledError):
            # ... unless the server stops (it cancels its requests) after ``cont`` may have
            # reached QEMU: the guest may have run on the sandbox's disk. The recorded VM is
            # left as a crash would leave it; the next start's recovery continues it.
            await p.envd.aclose()
            await p.machine.detach()
            raise
        free_later(orch, live, p.machine, p.envd, p.slot)
        if live.record.state == State.RESUMING:  # (a transition that failed changed nothing; one cut short did)
            await orch._revert(live, State.PAUSED, slot_index=None, end_at=before.end_at, timeout_s=before.timeout_s)
        if not isinstance(exc, (VmmError, OSError)):
            raise
        log.warning("sandbox %s: its parked VM could not be continued (%r); restoring its saved state",
                    live.id, exc)
        return None
    rec = live.record
    failure: BaseException | None = None
    await orch.checkpoints.crash_point("wake_after_cont")
    if "hang_after_wake" in orch.settings.faults:
        await p.machine.qmp("stop")  # injected fault (tests): a guest that stops answering
    try:
        await live.reidentify(p.envd, orch.settings.restore_timeout_s)
    except (EnvdError, asyncio.TimeoutError, OSError) as exc:
        failure = exc
    live.machine, live.slot, live.envd = p.machine, p.slot, p.envd
    # The exit watcher set when this machine first ran applies again (it checks live.machine).
    await orch._record(live, state=State.RUNNING, origin=cp, paused=None, end_at=time.time() + timeout,
                       timeout_s=timeout)
    if p.machine.exited:  # it died after cont, before the watcher could see it as running
        await orch._fail(live, "QEMU exited while the sandbox was resumed")
        raise VmmError(f"sandbox {rec.id}: its QEMU exited while it was resumed")
    if failure is not None:
        orch.init_later(live)
        why = failure.message if isinstance(failure, EnvdError) else "no answer"
        raise GuestError(f"sandbox {rec.id} runs again, but its guest agent did not answer within "
                         f"{orch.settings.restore_timeout_s:.0f}s after the resume ({why}); retry, or kill it")
    log.info("sandbox %s: resumed on its parked VM in %.1f ms (parked %.1f s)", rec.id,
             (time.perf_counter() - t0) * 1e3, time.monotonic() - p.since)
    return live.record
