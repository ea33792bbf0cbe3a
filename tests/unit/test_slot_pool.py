"""How many namespaces the slot pool keeps ready, whatever the address block allows."""

import pytest

from agentenv.errors import CapacityExhausted
from agentenv.network import SlotPool


def test_the_ready_slots_leave_room_for_sandboxes_in_a_small_block() -> None:
    assert SlotPool("test", "10.250.0.0/16", 16).target == 16
    small = SlotPool("test", "10.250.0.0/26", 16)  # 15 usable /30s
    assert (small.capacity, small.target) == (15, 7)


def test_a_node_out_of_slots_is_full_429_not_a_platform_failure() -> None:
    pool = SlotPool("test", "10.250.0.0/28", 16)  # 3 usable /30s
    for _ in range(pool.capacity):
        pool._next_index()
    with pytest.raises(CapacityExhausted, match="AENV_SLOT_CIDR"):
        pool._next_index()
