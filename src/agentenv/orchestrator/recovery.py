"""Start-up reconciliation: the store against what exists on the host.

QEMU processes outlive the server. On start each stored sandbox is re-adopted (its QEMU is
alive and answers QMP) or marked ``error`` with the reason; nothing is silently forgotten.
Host objects that no record owns (warm-pool shells of the previous run, namespaces, run dirs)
are removed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.envd_client import EnvdClient
from agentenv.errors import VmmError
from agentenv.orchestrator.lifecycle import State
from agentenv.orchestrator.sandbox import LiveSandbox
from agentenv.storage import remove_tree
from agentenv.vmm import Machine, find_qemu_pids, kill_pid
from agentenv.vmm.spec import spec_from_json

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)


async def recover(orch: Orchestrator) -> None:
    records = await orch.store.all()
    owned: set[str] = set()
    for rec in records:
        owned.add(rec.id)
        live = LiveSandbox(rec)
        orch._live[rec.id] = live
        if rec.state == State.ERROR:
            continue
        if rec.state == State.KILLING:
            await _kill_leftover(Path(rec.run_dir))
            if rec.slot_index is not None:
                await orch.slots.release(orch.slots.slot(rec.slot_index))
            orch._live.pop(rec.id)
            await orch.store.delete(rec.id)
            await remove_tree(Path(rec.run_dir))
            continue
        if rec.slot_index is not None:
            orch.slots.mark_used(rec.slot_index)
            live.slot = orch.slots.slot(rec.slot_index)
        try:
            spec = spec_from_json(json.loads((Path(rec.run_dir) / "machine.json").read_text()))
            live.machine = await Machine.adopt(spec)
        except (OSError, ValueError, VmmError) as exc:
            await orch._fail(live, f"QEMU was gone when the server restarted ({exc})")
            continue
        assert live.slot is not None
        live.envd = EnvdClient(live.slot.guest_url, access_token=rec.access_token)
        orch._watch(live)
        log.info("re-adopted sandbox %s (pid %d)", rec.id, live.machine.pid)
    # Leftovers that no record owns: previous warm-pool shells, half-made sandboxes.
    if orch.sandboxes_dir.exists():
        for d in orch.sandboxes_dir.iterdir():
            if d.name not in owned:
                await _kill_leftover(d)
                await remove_tree(d)
    # QEMU processes of this node that nothing owns any more (a launch or a template boot cut
    # short by a crash or a stop): sandboxes' and templates' alike live under the data dir.
    for pid, name in find_qemu_pids(str(orch.settings.data_dir) + "/").items():
        if name not in owned:
            log.warning("killing QEMU %d (%s) that no sandbox owns", pid, name)
            kill_pid(pid)
    keep = {r.record.slot_index for r in orch._live.values() if r.record.slot_index is not None}
    removed = await orch.slots.remove_orphans({k for k in keep if k is not None})
    if removed:
        log.info("removed %d orphaned network namespaces", len(removed))


async def _kill_leftover(run_dir: Path) -> None:
    """Kill the QEMU of a run dir if it is still running."""
    try:
        spec = spec_from_json(json.loads((run_dir / "machine.json").read_text()))
        machine = await Machine.adopt(spec)
    except (OSError, ValueError, VmmError):
        return
    await machine.kill()
