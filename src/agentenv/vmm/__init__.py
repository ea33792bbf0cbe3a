"""The VMM driver: QEMU microvm processes, driven over QMP.

It knows nothing about sandboxes, HTTP or the store: it takes a ``MachineSpec`` (plain paths
and numbers) and returns a running ``Machine``. See docs/mechanisms/machines.md.
"""

from agentenv.vmm import ksm
from agentenv.vmm.accel import AccelInfo, detect_accel
from agentenv.vmm.machine import Machine, VmLaunchFailed, find_qemu_pids, kill_pid
from agentenv.vmm.spec import MachineSpec

__all__ = ["Machine", "MachineSpec", "detect_accel", "AccelInfo", "VmLaunchFailed", "find_qemu_pids", "kill_pid", "ksm"]
