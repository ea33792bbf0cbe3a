"""Choosing the accelerator: KVM where the CPU has hardware virtualization, TCG otherwise.

A PVM host (``kvm_pvm`` loaded, no vmx/svm flag) exposes /dev/kvm but cannot run a stock guest
kernel (qemu-microvm-notes.md §1), so /dev/kvm alone is not enough to pick KVM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class AccelInfo:
    accel: Literal["kvm", "tcg"]
    reason: str
    forced: bool = False
    tsc_khz: int = 0

    def kernel_args(self, guest_aslr: bool = False) -> list[str]:
        """Guest kernel arguments this accelerator needs.

        Under TCG: (1) the guest's PIT calibration of the TSC fails at random (the emulated PIT
        runs at emulation speed), leaving the kernel without a clocksource, so give it the host's
        TSC rate, which TCG's emulated TSC ticks at; (2) TCG caches translated code by virtual
        address, so with address-space randomisation every new process re-translates ld.so and
        libc: ``norandmaps`` makes each exec 2-3x cheaper. ``guest_aslr`` keeps ASLR anyway."""
        if self.accel != "tcg":
            return []
        args = [f"tsc_early_khz={self.tsc_khz}", "tsc=reliable"] if self.tsc_khz else []
        if not guest_aslr:
            args.append("norandmaps")
        return args

    def cpu_model(self, tcg_cpu: str) -> str:
        """QEMU's -cpu: the host's CPU under KVM, the configured model under TCG."""
        return "host" if self.accel == "kvm" else tcg_cpu

    def qemu_args(self, tb_size_mb: int, tcg_cpu: str) -> list[str]:
        accel = "kvm" if self.accel == "kvm" else f"tcg,thread=multi,tb-size={tb_size_mb}"
        return ["-accel", accel, "-cpu", self.cpu_model(tcg_cpu)]


def host_tsc_khz() -> int:
    """Host TSC rate from /proc/cpuinfo (0 when unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError):
        pass
    return 0


def detect_accel(setting: str = "auto") -> AccelInfo:
    """Pick kvm or tcg; ``setting`` forces one ("kvm"/"tcg") or asks for detection ("auto")."""
    info = _detect(setting)
    if info.accel == "tcg":
        return AccelInfo(info.accel, info.reason, info.forced, host_tsc_khz())
    return info


def _detect(setting: str) -> AccelInfo:
    if setting == "tcg":
        return AccelInfo("tcg", "forced by configuration", forced=True)
    if setting == "kvm":
        return AccelInfo("kvm", "forced by configuration", forced=True)
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    hw = " vmx" in flags or " svm" in flags
    if not os.path.exists("/dev/kvm"):
        return AccelInfo("tcg", "/dev/kvm does not exist")
    if Path("/sys/module/kvm_pvm").exists() and not hw:
        return AccelInfo("tcg", "/dev/kvm is a PVM host device, which cannot run a stock guest kernel")
    if not hw:
        return AccelInfo("tcg", "the CPU exposes no vmx/svm flag")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelInfo("tcg", "/dev/kvm is not accessible to this user")
    return AccelInfo("kvm", "hardware virtualization available")
