"""Restore shells: a sandbox restored ahead of time and frozen, waiting to be handed out.

Making a shell: slot + overlay + QEMU in ``-incoming defer`` → load the template's device state
→ wait for the guest agent → ``/init`` with the sandbox's identity (id, fresh entropy, token) →
two warm-up commands → QMP ``stop``. Handing it out (``activate``) is then only ``cont`` + the
agent's ``/init`` with the clock (it stood still while frozen) and the create's env vars.

Why restore ahead and not only start QEMU ahead: under TCG a new QEMU process has an empty
translation cache, and the first pass of the guest's network stack and agent through it costs
hundreds of milliseconds. A primed shell has already paid that; while frozen it uses no CPU and
its guest clock does not advance. The guest state it carries is the template's plus its
priming; its identity is its own from the priming on (it is one VM of its own, so that is as
fresh as at activation), and the clock is set at activation.

A shell already carries the id of the sandbox it will become (its paths are named after it).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from agentenv.envd_client import EnvdClient, EnvdError
from agentenv.errors import GuestError
from agentenv.network import Slot, SlotPool, set_egress
from agentenv.orchestrator.cleanup import Cleanup
from agentenv.orchestrator.ids import new_access_token, new_sandbox_id
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
    envd: EnvdClient
    access_token: str
    frozen: bool = True  # primed and stopped (pool) or already running (made inline)

    async def destroy(self, slots: SlotPool) -> None:
        """Everything the shell holds goes, each part even when one before it failed (a QEMU
        that does not die still gives back its slot and run dir); the first error is raised."""
        try:
            await self.envd.aclose()
            await self.machine.kill()
        finally:
            try:
                await slots.release(self.slot)
            finally:
                await remove_tree(self.run_dir)

    async def activate(self, *, template: str, env_vars: dict[str, str], timeout_s: float,
                       faults: frozenset[str] = frozenset()) -> None:
        """Unfreeze and bring the guest up to date: a primed shell already has its identity
        (id, entropy, token) and only needs the clock (it stood still while frozen) and the
        create's env vars; an inline shell gets everything now. Raises GuestError if the agent
        does not answer within ``timeout_s``."""
        if self.frozen:
            self.machine.foreground()  # made in the background (make_shell): now a live sandbox
            await self.machine.qmp("cont")
        if "hang_after_restore" in faults:
            await self.machine.qmp("stop")  # injected fault: a guest that never answers
        try:
            if self.frozen:
                await asyncio.wait_for(self.envd.resume(env_vars), timeout_s)
            else:
                await self.envd.wait_healthy(timeout_s)
                await asyncio.wait_for(
                    self.envd.init(sandbox_id=self.sandbox_id, template_id=template, env_vars=env_vars,
                                   access_token=self.access_token),
                    timeout_s)
        except (EnvdError, asyncio.TimeoutError) as exc:
            why = exc.message if isinstance(exc, EnvdError) else "no answer"
            raise GuestError(f"sandbox {self.sandbox_id}: the guest agent did not answer within "
                             f"{timeout_s:.0f}s after restore ({why})") from exc


async def make_shell(snapshot: TemplateSnapshot, *, sandboxes_dir: Path, sock_dir: Path, slots: SlotPool,
                     accel: AccelInfo, tb_size_mb: int, restore_timeout_s: float, prime: bool = True,
                     nice: int = 0) -> Shell:
    """Acquire slot, overlay and QEMU for one future sandbox and restore it; undo everything on
    failure. ``prime`` (pool shells) also warms the activation and command paths and freezes
    it, its QEMU at CPU priority ``nice`` until activated (vmm/priority.py); a shell made
    inline for a waiting create skips that and is handed out running."""
    sandbox_id = new_sandbox_id()
    run_dir = sandboxes_dir / sandbox_id
    undo = Cleanup(f"shell {sandbox_id}")
    try:
        run_dir.mkdir(parents=True)
        undo.add("run_dir", lambda: remove_tree(run_dir))
        await create_overlay(run_dir / "disk.qcow2", snapshot.disk, "qcow2")
        slot = await slots.acquire()
        undo.add("slot", lambda: slots.release(slot))
        # No outbound traffic while the guest runs before anyone chose its policy (priming, or
        # an inline shell until its create applies the policy): nothing it opens then can
        # stay established past that policy.
        await set_egress(slot, [], ["0.0.0.0/0"])
        spec = MachineSpec(
            name=sandbox_id, run_dir=run_dir, sock_dir=sock_dir, kernel=Path(snapshot.kernel),
            initramfs=Path(snapshot.initramfs), disk=run_dir / "disk.qcow2", tools=Path(snapshot.tools),
            mem_path=snapshot.mem_file, memory_mb=snapshot.memory_mb, vcpus=snapshot.vcpus,
            accel=accel, mem_share=False, incoming=True, netns=slot.netns, tb_size_mb=tb_size_mb,
            tcg_cpu=snapshot.tcg_cpu,
            **guest_link_spec(),
        )
        tmp = run_dir / "machine.json.tmp"
        tmp.write_text(json.dumps(spec_to_json(spec)))
        os.replace(tmp, run_dir / "machine.json")
        machine = await Machine.launch(spec, nice=nice if prime else 0)
        undo.add("machine", machine.kill)
        await machine.prepare_incoming()
        await machine.load_state(snapshot.state, timeout=restore_timeout_s)
        envd = EnvdClient.for_guest(slot.guest_url)
        undo.add("envd", envd.aclose)
        token = new_access_token()
        if not prime:
            undo.release()
            return Shell(sandbox_id, run_dir, slot, machine, snapshot, envd, token, frozen=False)
        try:
            await envd.wait_healthy(restore_timeout_s)
            # The code paths of activation and of a first command, so that they are translated
            # (TCG) and paged in before the sandbox is handed out.
            # The sandbox's identity: this shell is one VM of its own, so its entropy and
            # token are as fresh now as at activation (the clock is set again then).
            await envd.init(sandbox_id=sandbox_id, template_id=snapshot.template, env_vars={}, access_token=token)
            await envd.warm_up()
        except EnvdError as exc:
            raise GuestError(f"restored guest agent did not answer within {restore_timeout_s:.0f}s "
                             f"({exc.message})") from exc
        await machine.qmp("stop")
        # Frozen, it opens nothing: its namespace may allow again what a sandbox without a
        # policy may reach; a create with a policy applies it before the guest runs (cont).
        await set_egress(slot, [], [])
        undo.release()
        return Shell(sandbox_id, run_dir, slot, machine, snapshot, envd, token)
    except BaseException:
        await undo.unwind()
        raise
