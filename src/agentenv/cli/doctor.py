"""`aenv doctor`: is this host ready to run sandboxes, and is the server up?

Each check says OK, FAIL (a required piece is missing: exit 1) or WARN (works, but worse or
not running yet), with a detail line saying what was found or what to do about it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.text import Text

from agentenv.cli import credentials
from agentenv.cli.client import ApiClient
from agentenv.cli.context import CliError, globals_of
from agentenv.cli.output import Column, OutputOption, choose_format, render
from agentenv.cli.server import DataDirOpt, settings_from


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True

    @property
    def status(self) -> str:
        return "OK" if self.ok else "FAIL" if self.required else "WARN"

    def to_json(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "detail": self.detail, "required": self.required}


def check_root() -> Check:
    if os.geteuid() == 0:
        return Check("root", True, "running as root")
    return Check("root", False, "AgentENV needs root (CAP_NET_ADMIN) to create network namespaces; "
                                "run `sudo aenv serve`")


def check_tool(name: str, version_args: list[str], hint: str = "run `aenv setup`") -> Check:
    path = shutil.which(name)
    if not path:
        return Check(name, False, f"not found on PATH; {hint}")
    try:
        res = subprocess.run([path, *version_args], capture_output=True, text=True, timeout=10)
        first = (res.stdout or res.stderr).strip().splitlines()
        version = first[0] if first else "version unknown"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name, False, f"{path} does not run: {exc}")
    return Check(name, True, f"{path}: {version}")


def check_accel(setting: str) -> Check:
    from agentenv.vmm.accel import detect_accel

    info = detect_accel(setting)
    slow = "" if info.accel == "kvm" else "; software emulation, much slower than KVM"
    return Check("accelerator", info.accel == "kvm" or info.forced, f"{info.accel}: {info.reason}{slow}",
                 required=False)


def check_shm(mem_root: Path) -> Check:
    base = next((p for p in (mem_root, *mem_root.parents) if p.exists()), Path("/"))
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        return Check("/dev/shm", False, f"{base} is not writable ({exc.strerror}); memory snapshots live there")
    free = shutil.disk_usage(base).free / 2**30
    return Check("/dev/shm", True, f"{base} writable, {free:.1f} GiB free")


def check_ksm(enabled: bool) -> Check:
    """KSM is opt-in (AENV_KSM=on); when asked for, the server refuses to start without it."""
    from agentenv.vmm import ksm

    why = ksm.unsupported_reason()
    if not enabled:
        can = "this host supports it" if why is None else f"this host cannot: {why}"
        return Check("KSM", True, f"off (AENV_KSM=on merges equal pages across one tenant's sandboxes; {can})",
                     required=False)
    if why is not None:
        return Check("KSM", False, f"AENV_KSM=on, but {why}; the server will not start with it")
    st = ksm.stats()
    running = "ksmd runs" if st and st.running else "ksmd is off (the server switches it on)"
    return Check("KSM", True, f"on: QEMU processes will be mergeable; {running}")


def check_images(cache: Path) -> Check:
    from agentenv.images import artifacts_present

    try:
        artifacts = artifacts_present(cache)
    except (OSError, ValueError, KeyError) as exc:
        return Check("guest images", False, f"{cache / 'default.json'} is unreadable ({exc}); run `aenv setup`")
    if artifacts is None:
        return Check("guest images", False, f"not provisioned under {cache}; run `aenv setup`")
    return Check("guest images", True, f"kernel {artifacts.kernel.name}, rootfs {artifacts.rootfs.name}")


def check_server(url: str, key: str | None) -> list[Check]:
    """Reachability (GET /health), then, with the API key, the server's accelerator and load
    (GET /health/details, which only the key's holders see)."""
    with ApiClient(url, key, timeout=3.0) as client:
        try:
            client.call("GET", "/health")
        except CliError as exc:
            return [Check("server", False, str(exc), required=False)]
        try:
            details = client.call("GET", "/health/details") or {}
        except CliError as exc:
            if exc.status != 401:
                return [Check("server", False, str(exc), required=False)]
            return [Check("server", True, f"{url} is up", required=False), Check("API key", False, str(exc))]
    counts = details.get("sandboxes") or {}
    summary = (f"{url} is up (v{details.get('version', '?')}), accel {details.get('accel', '?')}: "
               f"{details.get('accelReason', '')}; {sum(counts.values())} sandboxes")
    if "poolSize" in details:
        summary += f"; warm pool {details.get('poolReady', 0)}/{details['poolSize']}"
    return [Check("server", True, summary, required=False), Check("API key", True, "accepted by the server")]


def run_checks(settings: Any, url: str, key: str | None) -> list[Check]:
    return [
        check_root(),
        check_tool("qemu-system-x86_64", ["--version"]),
        check_tool("qemu-img", ["--version"]),
        check_accel(settings.accel),
        check_shm(settings.mem_root),
        check_ksm(settings.ksm),
        check_images(settings.cache),
        check_tool("nft", ["--version"]),
        check_tool("ip", ["-V"]),
        *check_server(url, key),
    ]


def _status_cell(c: dict[str, Any]) -> Text:
    return Text(c["status"], style={"OK": "green", "FAIL": "bold red", "WARN": "yellow"}[c["status"]])


def doctor(ctx: typer.Context, data_dir: DataDirOpt = None, output: OutputOption = None) -> None:
    """Check that this host can run sandboxes and that the server answers."""
    settings = settings_from(AENV_DATA_DIR=data_dir)
    g = globals_of(ctx)
    creds = credentials.resolve(g.url, g.key)
    checks = run_checks(settings, creds.url, creds.key)
    rows = [c.to_json() for c in checks]
    columns = [Column("CHECK", lambda c: c["check"]), Column("STATUS", _status_cell),
               Column("DETAIL", lambda c: c["detail"], wrap=True)]
    render(choose_format(ctx, output), rows, columns)
    if any(not c.ok and c.required for c in checks):
        raise typer.Exit(1)
