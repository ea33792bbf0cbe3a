"""What a machine is made of, as plain values (the VMM's typed configuration)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from agentenv.config import DEFAULT_TCG_CPU
from agentenv.vmm.accel import AccelInfo
from agentenv.vmm.kernel_stub import restore_stub


@dataclass(frozen=True)
class MachineSpec:
    """One QEMU microvm. ``mem_share`` is True for a template being built (its RAM file is the
    template), False for a sandbox (copy-on-write private mapping of the template's file)."""

    name: str
    run_dir: Path  # console.log, qemu.pid, machine.json live here
    sock_dir: Path  # short path for the QMP socket (Unix socket paths are limited to 107 bytes)
    kernel: Path
    initramfs: Path
    disk: Path  # qcow2 overlay
    tools: Path  # the read-only tools drive (agent + its Python), shared by every machine
    mem_path: Path
    memory_mb: int
    vcpus: int
    accel: AccelInfo
    mem_share: bool = False
    incoming: bool = False  # start in -incoming defer, waiting for a device state
    device_state_only: bool = False  # the incoming state has no RAM and no configuration section
    netns: str | None = None
    tap: str | None = "tap0"
    guest_mac: str = ""  # the network layer chooses the guest link's addresses
    guest_ip: str = ""  # address/prefix, configured by the guest init from the command line
    guest_gw: str = ""
    tb_size_mb: int = 128
    tcg_cpu: str = DEFAULT_TCG_CPU  # a restore must use the model its state was saved with
    kernel_args: tuple[str, ...] = field(default_factory=tuple)
    guest_aslr: bool = False

    @property
    def qmp_path(self) -> Path:
        digest = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:16]
        return self.sock_dir / f"{digest}.qmp"

    @property
    def console_log(self) -> Path:
        return self.run_dir / "console.log"

    def console_tail(self, n: int = 800) -> str:
        """The end of the guest's serial console, for error messages ("" when there is none)."""
        try:
            return self.console_log.read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    @property
    def qemu_log(self) -> Path:
        return self.run_dir / "qemu.log"


def build_argv(spec: MachineSpec) -> list[str]:
    """The QEMU command line (qemu-microvm-notes.md §3)."""
    share = "on" if spec.mem_share else "off"
    append = " ".join(
        ["console=ttyS0", "panic=-1", "quiet", "loglevel=3", "random.trust_cpu=on",
         f"aenv.ip={spec.guest_ip}", f"aenv.gw={spec.guest_gw}", *spec.accel.kernel_args(spec.guest_aslr), *spec.kernel_args]
    )
    argv = [
        "qemu-system-x86_64",
        "-name", spec.name,
        "-M", "microvm,acpi=on,memory-backend=mem",
        *spec.accel.qemu_args(spec.tb_size_mb, spec.tcg_cpu),
        "-m", f"{spec.memory_mb}M",
        "-smp", str(spec.vcpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        # A restored machine never boots: a stub kernel and no initramfs (kernel_stub.py).
        *(["-kernel", str(restore_stub(spec.kernel))] if spec.incoming else
          ["-kernel", str(spec.kernel), "-initrd", str(spec.initramfs)]),
        "-append", append,
        "-serial", f"file:{spec.console_log}",
        "-object", f"memory-backend-file,id=mem,size={spec.memory_mb}M,mem-path={spec.mem_path},share={share}",
        # cache=unsafe: a guest flush does not fdatasync on the host. Writes still reach the
        # host page cache (they survive QEMU and server crashes, not a host crash), and a
        # snapshot's stop window no longer waits for the host to write back what the guest wrote.
        "-drive", f"file={spec.disk},if=none,id=d0,format=qcow2,cache=unsafe,discard=unmap",
        "-device", "virtio-blk-device,drive=d0,serial=aenv-root",
        "-drive", f"file={spec.tools},if=none,id=t0,format=raw,readonly=on,cache=none,aio=threads",
        "-device", "virtio-blk-device,drive=t0,serial=aenv-tools",
        "-object", "rng-random,id=rng0,filename=/dev/urandom",
        "-device", "virtio-rng-device,rng=rng0",
        "-qmp", f"unix:{spec.qmp_path},server=on,wait=off",
    ]
    if spec.tap:
        argv += [
            "-netdev", f"tap,id=n0,ifname={spec.tap},script=no,downscript=no",
            "-device", f"virtio-net-device,netdev=n0,mac={spec.guest_mac}",
        ]
    if spec.incoming:
        # -S: the guest runs only when the host says ``cont`` after the load, never on its own
        # when the incoming state is complete: a caller can record the VM first (a resume).
        argv += ["-incoming", "defer", "-S"]
    if spec.device_state_only:
        # a xen-save-devices-state file (pause, snapshot, fork) has no configuration section
        argv += ["-global", "migration.send-configuration=off"]
    if spec.netns:
        argv = ["ip", "netns", "exec", spec.netns, *argv]
    return argv


def spec_to_json(spec: MachineSpec) -> dict[str, object]:
    """Serialise a spec so a restarted server can adopt the machine (see Machine.adopt)."""
    d = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    for k, v in list(d.items()):
        if isinstance(v, Path):
            d[k] = str(v)
    d["accel"] = {"accel": spec.accel.accel, "reason": spec.accel.reason,
                  "forced": spec.accel.forced, "tsc_khz": spec.accel.tsc_khz}
    d["kernel_args"] = list(spec.kernel_args)
    return d


def spec_from_json(d: dict[str, object]) -> MachineSpec:
    """The inverse of spec_to_json. A record that is not one (hand-edited, truncated, or written
    by a version with other fields) raises ValueError, so recovery fails that one sandbox with
    the reason instead of refusing to start."""
    try:
        d = dict(d)
        for k in ("run_dir", "sock_dir", "kernel", "initramfs", "disk", "tools", "mem_path"):
            d[k] = Path(str(d[k]))
        d["accel"] = AccelInfo(**d["accel"])  # type: ignore[arg-type]
        d["kernel_args"] = tuple(d["kernel_args"])  # type: ignore[arg-type]
        return MachineSpec(**d)  # type: ignore[arg-type]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"machine.json is not a machine record this version reads ({exc!r})") from None
