"""``idle_pss_ksm_mb``: idle sandboxes as ``idle_pss_mb`` measures them, on a second node that
runs with ``AENV_KSM=on``, once ksmd has scanned them.

KSM is opt-in (vmm/ksm.py), so the main node runs without it and its ``idle_pss_mb`` is the
baseline of the same run. ksmd's rate is host-wide: the scenario sets a fast one for its
duration (the host's default takes minutes to go over a few GiB) and puts the host's
settings back afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from agentenv.bench.node import LocalNode, pss_kb, qemu_pids
from agentenv.bench.stats import wait_pool
from agentenv.vmm.ksm import KSM_SYSFS

KSM_CIDR = "10.217.18.0/24"
KNOBS = ("run", "pages_to_scan", "sleep_millisecs")


@contextmanager
def host_ksmd_settings_kept() -> Iterator[None]:
    """The host's ksmd settings as they are now (whether it runs included) are put back at the
    end, whatever a server with AENV_KSM=on or ``scan_fast`` changed in between."""
    saved = {k: (KSM_SYSFS / k).read_text().strip() for k in KNOBS}
    try:
        yield
    finally:
        for k in reversed(KNOBS):
            (KSM_SYSFS / k).write_text(saved[k] + "\n")


def scan_fast() -> None:
    """ksmd at a rate that goes over a few GiB in seconds (the host's default takes minutes)."""
    (KSM_SYSFS / "pages_to_scan").write_text("5000\n")
    (KSM_SYSFS / "sleep_millisecs").write_text("10\n")


def _full_scans() -> int:
    return int((KSM_SYSFS / "full_scans").read_text())


def bench_idle_pss_ksm(node: LocalNode, api: httpx.Client, runs: int, count: int = 8) -> dict[str, list[float]]:
    if not (KSM_SYSFS / "run").exists():
        return {}  # no KSM in this kernel: the metric is absent from the report
    knode = LocalNode(node.data_dir.parent / "ksm-node", KSM_CIDR, Path(node.env["AENV_CACHE_DIR"]),
                      AENV_POOL_SIZE=str(count), AENV_SLOT_POOL_SIZE=str(count), AENV_KSM="on",
                      AENV_ACCEL=node.env.get("AENV_ACCEL", "auto"))
    samples: list[float] = []
    with host_ksmd_settings_kept():  # the node switches ksmd on; the host gets its state back
        try:
            knode.start()
            with knode.client() as kapi:
                kapi.post("/sandboxes", json={"templateID": "base"}).raise_for_status()  # builds its template
                wait_pool(knode, 120)
                ids = [kapi.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
                       for _ in range(count)]
                wait_pool(knode, 120)
                time.sleep(3)
                scan_fast()
                start = _full_scans()
                deadline = time.monotonic() + 120
                while _full_scans() < start + 3 and time.monotonic() < deadline:
                    time.sleep(0.5)
                for sid in ids:
                    (pid,) = qemu_pids(sid)
                    samples.append(pss_kb(pid) / 1024)
        finally:
            knode.kill_all()
    return {"idle_pss_ksm_mb": samples}
