"""The VMM driver: QEMU microvm processes, driven over QMP.

It knows nothing about sandboxes, HTTP or the store: it takes a ``MachineSpec`` (plain paths
and numbers) and returns a running ``Machine``. See docs/mechanisms/machines.md.
"""

from agentenv.vmm.accel import detect_accel, AccelInfo
from agentenv.vmm.spec import MachineSpec
from agentenv.vmm.machine import Machine, VmLaunchFailed, find_qemu_pids, kill_pid

__all__ = ["Machine", "MachineSpec", "detect_accel", "AccelInfo", "VmLaunchFailed", "find_qemu_pids", "kill_pid"]
