"""Restore shells: a QEMU process waiting in ``-incoming defer`` with its disk overlay and
network slot ready, so that creating a sandbox is only "load device state + continue".

A shell is made for one template snapshot and already carries the id of the sandbox it will
become (its paths, QMP socket included, are named after it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from agentenv.network import Slot, SlotPool
from agentenv.orchestrator.cleanup import Cleanup
from agentenv.orchestrator.ids import new_sandbox_id
from agentenv.orchestrator.templates import guest_link_spec
from agentenv.storage import TemplateSnapshot, create_overlay, remove_tree
from agentenv.vmm import AccelInfo, Machine, MachineSpec
from agentenv.vmm.spec import spec_to_json


@dataclass
class Shell:
    sandbox_id: str
    run_dir: Path
    slot: Slot
    machine: Machine
    snapshot: TemplateSnapshot

    async def destroy(self, slots: SlotPool) -> None:
        await self.machine.kill()
        await slots.release(self.slot)
        await remove_tree(self.run_dir)


async def make_shell(snapshot: TemplateSnapshot, *, sandboxes_dir: Path, sock_dir: Path, slots: SlotPool,
                     accel: AccelInfo, tb_size_mb: int) -> Shell:
    """Acquire slot, overlay and QEMU for one future sandbox; undo everything on failure."""
    sandbox_id = new_sandbox_id()
    run_dir = sandboxes_dir / sandbox_id
    undo = Cleanup(f"shell {sandbox_id}")
    try:
        run_dir.mkdir(parents=True)
        undo.add("run_dir", lambda: remove_tree(run_dir))
        await create_overlay(run_dir / "disk.qcow2", snapshot.disk, "qcow2")
        slot = await slots.acquire()
        undo.add("slot", lambda: slots.release(slot))
        spec = MachineSpec(
            name=sandbox_id, run_dir=run_dir, sock_dir=sock_dir, kernel=Path(snapshot.kernel),
            initramfs=Path(snapshot.initramfs), disk=run_dir / "disk.qcow2",
            mem_path=snapshot.mem_file, memory_mb=snapshot.memory_mb, vcpus=snapshot.vcpus,
            accel=accel, mem_share=False, incoming=True, netns=slot.netns, tb_size_mb=tb_size_mb,
            **guest_link_spec(),
        )
        tmp = run_dir / "machine.json.tmp"
        tmp.write_text(json.dumps(spec_to_json(spec)))
        os.replace(tmp, run_dir / "machine.json")
        machine = await Machine.launch(spec)
        undo.add("machine", machine.kill)
        await machine.prepare_incoming()
        undo.release()
        return Shell(sandbox_id, run_dir, slot, machine, snapshot)
    except BaseException:
        await undo.unwind()
        raise
