"""The benchmark command runs every scenario it documents (at one run each): the figures in
docs/benchmarks.md come from it, so it must not rot while the code under it changes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentenv.bench.node import CACHE
from agentenv.bench.scenarios import SCENARIOS
from agentenv.config import DEFAULT_TCG_CPU
from tests.framework import host

pytestmark = pytest.mark.timeout(1500)

AENV = [sys.executable, "-m", "agentenv.cli.main"]
CACHE_ARG = ["--cache-dir", str(CACHE)]  # the provisioned images, whatever the environment says


def test_bench_reports_every_metric_once_through() -> None:
    r = subprocess.run([*AENV, "bench", "--json", "--runs", "1", *CACHE_ARG], capture_output=True, text=True, timeout=1400)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["accel"] in ("kvm", "tcg") and report["machine"]["cpus"] >= 1
    assert report["guestCpu"] == ("host" if report["accel"] == "kvm" else DEFAULT_TCG_CPU)
    metrics = report["metrics"]
    always = {"cold_boot_ms", "template_snapshot_ms", "create_coldboot_ms"}  # measured on every run
    assert set(metrics) == set(SCENARIOS) | always, f"missing: {set(SCENARIOS) | always - set(metrics)}"
    for name, m in metrics.items():
        assert m["runs"] >= 1, name
        assert 0 < m["min"] <= m["median"] <= m["p99"], (name, m)
    # The bench node and its VMs are gone with the command.
    assert host.qemu_pids("aenv-bench") == set()


def test_a_bench_stopped_with_sigterm_leaves_no_vm() -> None:
    import signal
    import time

    proc = subprocess.Popen([*AENV, "bench", "--json", "--runs", "3", "--only", "create_ms", *CACHE_ARG],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not host.qemu_pids("aenv-bench") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert host.qemu_pids("aenv-bench"), "the bench never started a VM"
        time.sleep(2)  # mid-run: the template boot or the pool filling
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        assert host.qemu_pids("aenv-bench") == set()
    finally:
        proc.kill()
        proc.wait()
