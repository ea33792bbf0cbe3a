"""A live sandbox: its record plus the host objects that run it.

The aggregate stays thin: it holds references and a lock, it does not contain mechanism code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from agentenv.envd_client import EnvdClient
from agentenv.network import Slot
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.store import SandboxRecord
from agentenv.vmm import Machine


@dataclass
class Parked:
    """The stopped VM of a paused sandbox, kept for a quick resume (orchestrator/parking.py)."""

    machine: Machine
    envd: EnvdClient
    slot: Slot
    since: float  # time.monotonic() at the pause
    expiry: asyncio.TimerHandle | None = None


@dataclass
class LiveSandbox:
    record: SandboxRecord
    machine: Machine | None = None
    slot: Slot | None = None
    envd: EnvdClient | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Writes of the record, one at a time (Orchestrator._save); ``lock`` is the operation's.
    saving: asyncio.Lock = field(default_factory=asyncio.Lock)
    releasing: asyncio.Task[None] | None = None  # host resources being freed after a pause
    parked: Parked | None = None  # paused, with its stopped VM kept (machine/slot/envd are None)

    async def settled(self) -> None:
        """Wait until the resources of a previous pause are freed (errors were logged). Any
        number of callers may wait (a resume, a kill, an eviction for memory); a waiter that
        is cancelled does not cancel the freeing."""
        task = self.releasing
        if task is None:
            return
        try:
            await asyncio.shield(task)
        except Exception:  # noqa: BLE001 — a failed kill is logged; the run dir is reused anyway
            import logging

            logging.getLogger(__name__).exception("freeing the paused VM of %s failed", self.id)
        finally:
            if self.releasing is task and task.done():
                self.releasing = None

    def __repr__(self) -> str:
        return f"<Sandbox {self.record.id} {self.record.state.value.upper()}>"

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def vm(self) -> Machine | None:
        """The QEMU that holds this sandbox's memory: its running VM, or its parked one."""
        return self.machine or (self.parked.machine if self.parked else None)

    async def reidentify(self, envd: EnvdClient, timeout_s: float) -> None:
        """Give the guest the host's clock (it stood still while its VM was stopped) and its
        identity again, through envd's ``/init``. Raises EnvdError, TimeoutError or OSError."""
        rec = self.record
        await asyncio.wait_for(envd.init(sandbox_id=rec.id, template_id=rec.template, env_vars={},
                                         access_token=rec.access_token), timeout_s)

    def past_end(self) -> bool:
        """Running past its end time: the reaper kills it, or pauses it (auto-pause); failed
        (``error``) past its end time, which a failure pushes out by AENV_ERROR_KEEP_S: the
        reaper kills it, so that failed sandboxes nobody deletes (a trainer that moved on) do
        not pile up with their disks. Asked again by the kill or pause once it holds the lock
        (a pause or a new timeout may have come first)."""
        return self.record.state in (State.RUNNING, State.ERROR) and self.record.end_at <= time.time()
