"""How many namespaces the slot pool keeps ready, whatever the address block allows."""

from agentenv.network import SlotPool


def test_the_ready_slots_leave_room_for_sandboxes_in_a_small_block() -> None:
    assert SlotPool("test", "10.250.0.0/16", 16).target == 16
    small = SlotPool("test", "10.250.0.0/26", 16)  # 15 usable /30s
    assert (small.capacity, small.target) == (15, 7)
