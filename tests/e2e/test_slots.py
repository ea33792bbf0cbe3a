"""Network slots made for real (namespaces, veth pairs, nft), without a server: a slot whose
making stops half-way leaves nothing behind, however it stops."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from agentenv.errors import ExternalCommandError
from agentenv.network import SlotPool
from agentenv.network import slots as slots_module
from tests.framework.net import node_cidr

CIDR = node_cidr(61)


def _leftovers(pool: SlotPool, index: int) -> list[str]:
    slot = pool.slot(index)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show", slot.veth], capture_output=True, text=True).stdout
    return [n for n in netns if n == slot.netns] + ([slot.veth] if links.strip() else [])


@pytest.mark.parametrize("how", ["a command that cannot start", "a cancelled create"])
def test_a_slot_stopped_half_way_leaves_nothing_and_its_index_is_usable_again(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second of the two commands that make a slot does not run through: before, only a
    failed command's exit status undid the first (an OSError or a cancellation left the veth
    and the namespace, and the next slot of that index failed with "File exists")."""
    real_run = slots_module.run
    calls = 0

    async def second_fails(argv: list[str], **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            if how == "a cancelled create":
                await asyncio.sleep(60)
            raise OSError(24, "injected: Too many open files")
        return await real_run(argv, **kw)

    async def main() -> None:
        pool = SlotPool("tslot", CIDR, 0, dns=False)
        monkeypatch.setattr(slots_module, "run", second_fails)
        if how == "a cancelled create":
            task = asyncio.ensure_future(pool.acquire())
            while calls < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(OSError, match="injected"):
                await pool.acquire()
        monkeypatch.setattr(slots_module, "run", real_run)
        await asyncio.sleep(0.5)  # (a shielded clean-up may still be running after a cancel)
        assert _leftovers(pool, 1) == []
        slot = await pool.acquire()  # the same index again
        try:
            assert slot.index == 1
        finally:
            await pool.release(slot)
        assert _leftovers(pool, 1) == []

    asyncio.run(main())


def test_a_failed_command_is_a_network_error_naming_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = slots_module.run

    async def ns_script_fails(argv: list[str], **kw: Any) -> Any:
        if argv[:3] == ["ip", "netns", "exec"]:
            raise ExternalCommandError(argv, 1, "injected: nft said no")
        return await real_run(argv, **kw)

    async def main() -> None:
        pool = SlotPool("tslot", CIDR, 0, dns=False)
        monkeypatch.setattr(slots_module, "run", ns_script_fails)
        with pytest.raises(Exception, match="cannot create network slot .*injected"):
            await pool.acquire()
        monkeypatch.setattr(slots_module, "run", real_run)
        assert _leftovers(pool, 1) == []

    asyncio.run(main())


def _tracked(addr: str) -> list[str]:
    with open("/proc/net/nf_conntrack") as f:
        return [ln for ln in f if f"src={addr} " in ln or f"dst={addr} " in ln]


def test_a_slot_made_again_carries_no_connection_of_the_sandbox_before() -> None:
    """The host's conntrack table outlives a slot. An entry of the sandbox that had the
    address before (a UDP flow its peer keeps alive) would carry the peer's packets into the
    next sandbox given the address, as established traffic its egress policy never sees."""
    table = "aenvtest_ct"
    # The host tracks connections while a rule needs it, as the node's own table does.
    rules = f"table ip {table} {{\n chain f {{\n type filter hook forward priority 0; ct state established accept\n }}\n}}\n"

    async def main() -> None:
        pool = SlotPool("tslot", CIDR, 0, dns=False)
        subprocess.run(["nft", "-f", "-"], input=rules.encode(), check=True, capture_output=True)
        slot = None
        try:
            slot = await pool.acquire()
            subprocess.run(["ip", "netns", "exec", slot.netns, "bash", "-c",
                            "for p in 9001 9002 9003; do echo x > /dev/udp/203.0.113.9/$p; done"], check=True)
            assert len(_tracked(slot.ns_addr)) == 3, "the flows were not tracked: the test proves nothing"
            await pool.release(slot)
            slot = await pool.acquire()  # the same index again: its address too
            assert slot.index == 1 and _tracked(slot.ns_addr) == []
        finally:
            if slot is not None:
                await pool.release(slot)
            subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True)

    asyncio.run(main())
