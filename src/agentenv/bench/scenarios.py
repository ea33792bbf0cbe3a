"""The benchmark scenarios.

API-level figures (create, burst, exec) go through a real server started for the benchmark
(``LocalNode``), as a user's requests would. Machine-level figures (cold boot, template
snapshot) drive the VMM, network and envd mechanisms directly, since no API call cold-boots.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from agentenv.bench.e2b_sdk import (
    DOMAIN,
    bench_e2b_burst50,
    bench_e2b_exec,
    bench_e2b_transfer,
    bench_e2b_tti,
)
from agentenv.bench.images import bench_pull, bench_template_build, make_pull_image
from agentenv.bench.ksm import KSM_CIDR, bench_idle_pss_ksm
from agentenv.bench.node import CACHE, LocalNode, pss_kb, qemu_pids, scratch_host
from agentenv.bench.registry import LocalRegistry
from agentenv.bench.saved_states import (
    MIGRATE_CIDR,
    PAUSE_LINGER_S,
    bench_fork,
    bench_migrate_baseline,
    bench_pause_resume,
    bench_reset_group,
    bench_snapshot_disk,
)
from agentenv.bench.stats import summarize, wait_pool
from agentenv.config import Settings
from agentenv.envd_client import EnvdClient
from agentenv.images import artifacts_present
from agentenv.network import (
    remove_slots_in,
)
from agentenv.orchestrator.templates import guest_link_spec
from agentenv.storage import create_overlay, remove_tree
from agentenv.vmm import Machine, MachineSpec, detect_accel, find_qemu_pids, kill_pid

BENCH_CIDR = "10.217.0.0/20"
COLD_CIDR = "10.217.16.0/24"
Report = dict[str, dict[str, float | int]]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


# -- machine level: cold boot and template snapshot -------------------------------------------

async def _cold_boots(runs: int, tmp: Path, cache: Path, accel_setting: str) -> dict[str, list[float]]:
    """Cold boot to agent answer; template snapshot; and create-by-cold-boot (slot + overlay +
    boot + agent init), the baseline that restore-from-snapshot is compared with."""
    arts = artifacts_present(cache)
    assert arts is not None, f"no provisioned images in {cache}; run `aenv setup`"
    accel = detect_accel(accel_setting)
    out: dict[str, list[float]] = {"cold_boot_ms": [], "template_snapshot_ms": [], "create_coldboot_ms": []}
    async with scratch_host(tmp / "cold", COLD_CIDR) as (settings, slots):
        for i in range(runs):
            d = tmp / f"cold{i}"
            t_create = time.perf_counter()
            slot = await slots.acquire()
            await create_overlay(d / "disk.qcow2", arts.rootfs, "raw")
            spec = MachineSpec(name=f"bench-cold{i}", run_dir=d, sock_dir=settings.sock_dir, kernel=arts.kernel,
                               initramfs=arts.initramfs, disk=d / "disk.qcow2", tools=arts.tools,
                               mem_path=settings.mem_dir / f"cold{i}.mem", memory_mb=512, vcpus=1,
                               accel=accel, mem_share=True, netns=slot.netns, tcg_cpu=settings.tcg_cpu,
                               **guest_link_spec())
            t_boot = time.perf_counter()
            m = await Machine.launch(spec)
            try:
                async with EnvdClient.for_guest(slot.guest_url) as envd:
                    await envd.wait_healthy(300)
                    out["cold_boot_ms"].append(_ms(t_boot))
                    await envd.init(sandbox_id=f"cold{i}", template_id="base", env_vars={}, access_token=None)
                    out["create_coldboot_ms"].append(_ms(t_create))
                t_snap = time.perf_counter()
                await m.save_template_state(d / "state")
                out["template_snapshot_ms"].append(_ms(t_snap))
            finally:
                await m.kill()
                await slots.release(slot)
                spec.mem_path.unlink(missing_ok=True)
                await remove_tree(d)
    return out


# -- API level --------------------------------------------------------------------------------

def _create(api: httpx.Client, **body: object) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = api.post("/sandboxes", json={"templateID": "base", **body})
    dt = _ms(t0)
    r.raise_for_status()
    return r.json()["sandboxID"], dt


def _wait_pool(node: LocalNode, api: httpx.Client, timeout: float = 60) -> None:
    """Let the warm pool refill so each create measures the steady state, not a cold pool."""
    wait_pool(node, timeout)


def bench_create(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """Create from a full pool, and kill (``DELETE`` → 204: QEMU gone, run dir removed)."""
    samples, kills = [], []
    for _ in range(runs):
        _wait_pool(node, api)
        sid, dt = _create(api)
        samples.append(dt)
        t0 = time.perf_counter()
        api.delete(f"/sandboxes/{sid}").raise_for_status()
        kills.append(_ms(t0))
    return {"create_ms": samples, "kill_ms": kills}


def bench_rollouts(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """Rollouts back to back, as a trainer runs them: create, one command, kill; ten times the
    runs (100 in a full bench) while the pool refills in the background. Creates outpace
    restores on two cores, so the pool runs dry and the later cycles restore inline: the median
    is the steady state, the minimum a pooled create (``create_ms``, measured with a full pool,
    is the baseline)."""
    _wait_pool(node, api)
    samples = []
    for _ in range(max(20, runs * 10)):
        t0 = time.perf_counter()
        sid, _ = _create(api)
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["sh", "-c", "echo hi"]})
        r.raise_for_status()
        if r.json()["stdout"] != "hi\n":
            raise RuntimeError(f"rollout command answered {r.json()!r}")
        api.delete(f"/sandboxes/{sid}").raise_for_status()
        samples.append(_ms(t0))
    return {"rollout_cycle_ms": samples}


def _burst(api: httpx.Client, count: int) -> list[str]:
    """``count`` concurrent creates; their sandbox ids."""
    with ThreadPoolExecutor(count) as ex:
        return [sid for sid, _ in ex.map(lambda _i: _create(api), range(count))]


def _kill(api: httpx.Client, ids: list[str]) -> None:
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda s: api.delete(f"/sandboxes/{s}"), ids))


def bench_burst16(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    samples = []
    for _ in range(runs):
        _wait_pool(node, api)
        t0 = time.perf_counter()
        ids = _burst(api, 16)
        samples.append(_ms(t0))
        _kill(api, ids)
    return {"create_burst16_ms": samples}


def bench_exec(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    _wait_pool(node, api)
    sid, _ = _create(api)
    _wait_pool(node, api)  # measure without the pool refilling on the other core

    def run_true() -> None:
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["true"]}).raise_for_status()

    def round_trips() -> list[float]:
        out = []
        for _ in range(max(runs, 20)):
            t0 = time.perf_counter()
            run_true()
            out.append(_ms(t0))
        return out

    try:
        samples = round_trips()
        # The guest's own cost of running `true` (fork + exec + wait), measured inside the guest.
        script = ("import subprocess,time\nts=[]\nfor _ in range(20):\n t=time.perf_counter();"
                  " subprocess.run(['true']); ts.append((time.perf_counter()-t)*1000)\nprint(*ts)")
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["python3", "-c", script]})
        guest = [float(x) for x in r.json()["stdout"].split()]
        # A long rollout: the same round trip once the sandbox has run 1,000 commands (the
        # agent keeps finished commands for 5 minutes; their number must not slow the next).
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda _i: run_true(), range(1000 - len(samples))))
        return {"exec_rtt_ms": samples, "guest_true_ms": guest, "exec_rtt_after_1000_ms": round_trips()}
    finally:
        api.delete(f"/sandboxes/{sid}")


def bench_exec_refill(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """The exec round trip of a live sandbox while the warm pool refills behind it: a burst of
    creates has just emptied the pool (its sandboxes killed at once), and the node restores
    and primes new shells on the same two cores. Baseline: ``exec_rtt_ms``, measured with the
    pool full. The pool's VMs run at ``AENV_BACKGROUND_NICE`` until handed out (vmm/priority.py);
    ``AENV_BACKGROUND_NICE=0`` in the bench's environment measures them on equal terms."""
    _wait_pool(node, api)
    sid, _ = _create(api)
    samples: list[float] = []
    try:
        for _ in range(max(2, runs // 5)):
            _wait_pool(node, api)
            _kill(api, _burst(api, 16))
            for _ in range(10):
                t0 = time.perf_counter()
                api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["true"]}).raise_for_status()
                samples.append(_ms(t0))
        return {"exec_rtt_refill_ms": samples}
    finally:
        api.delete(f"/sandboxes/{sid}")


# One turn of a coding agent's rollout, over and over: Python, git, ls and a bare command.
TOOL_CALLS: dict[str, str | list[str]] = {
    "python": "python3 -c 'import json, subprocess, pathlib; print(1)'",
    "git": "git --version",
    "ls": "ls -la /usr/bin | wc -l",
    "true": ["true"],
}


def bench_tool_calls(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    """Round trips in a sandbox that runs a mix of programs, as a rollout does. Under TCG what
    each costs depends on whether the guest code of all of them fits in the VM's translation
    cache (AENV_TCG_TB_MB): when it does not, every turn retranslates the lot. Baseline in the
    same run: ``exec_rtt_ms``, the same ``true`` in a sandbox that runs nothing else."""
    _wait_pool(node, api)
    sid, _ = _create(api)
    _wait_pool(node, api)
    out: dict[str, list[float]] = {"tool_call_python_ms": [], "tool_call_true_ms": []}
    try:
        for turn in range(2 + max(runs, 10)):  # two turns to warm up
            for name, cmd in TOOL_CALLS.items():
                t0 = time.perf_counter()
                api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd}).raise_for_status()
                if turn >= 2 and f"tool_call_{name}_ms" in out:
                    out[f"tool_call_{name}_ms"].append(_ms(t0))
        return out
    finally:
        api.delete(f"/sandboxes/{sid}")


def _pss_parts_kb(pid: int) -> tuple[int, int]:
    """PSS of the guest-RAM mapping (the template's memory file: what the guest itself costs)
    and of TCG's translation cache (QEMU's one anonymous read-write-execute mapping; none
    under KVM). The rest of a sandbox's PSS is QEMU's own heap, binary and libraries."""
    ram = tcg = 0
    part = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
            if len(head) >= 6 and head[5].endswith(".mem"):
                part = "ram"
            elif len(head) == 5 and head[1] == "rwxp":
                part = "tcg"
            else:
                part = ""
        elif part and line.startswith("Pss:"):
            if part == "ram":
                ram += int(head[1])
            else:
                tcg += int(head[1])
    return ram, tcg


def bench_idle_pss(node: LocalNode, api: httpx.Client, runs: int, count: int = 8) -> dict[str, list[float]]:
    """Host PSS per idle sandbox of the 512 MiB template: ``count`` sandboxes, idle for 3 s,
    the PSS of each QEMU process (shared template pages are split between them)."""
    samples: list[float] = []
    guest: list[float] = []
    tcg: list[float] = []
    for _ in range(max(1, runs // 5)):
        _wait_pool(node, api)
        ids = [_create(api)[0] for _ in range(count)]
        try:
            _wait_pool(node, api)
            time.sleep(3)
            for sid in ids:
                (pid,) = qemu_pids(sid)
                samples.append(pss_kb(pid) / 1024)
                ram_kb, tcg_kb = _pss_parts_kb(pid)
                guest.append(ram_kb / 1024)
                tcg.append(tcg_kb / 1024)
        finally:
            for sid in ids:
                api.delete(f"/sandboxes/{sid}")
    return {"idle_pss_mb": samples, "idle_guest_ram_pss_mb": guest, "idle_tcg_cache_pss_mb": tcg}


Scenario = Callable[..., dict[str, list[float]]]  # (node, api, runs[, image]) → samples

# metric → the scenario that measures it (one scenario may measure several metrics)
SCENARIOS: dict[str, Scenario] = {
    "create_ms": bench_create,
    "kill_ms": bench_create,
    "create_burst16_ms": bench_burst16,
    "rollout_cycle_ms": bench_rollouts,
    "exec_rtt_ms": bench_exec,
    "guest_true_ms": bench_exec,
    "exec_rtt_after_1000_ms": bench_exec,
    "exec_rtt_refill_ms": bench_exec_refill,
    "tool_call_python_ms": bench_tool_calls,
    "tool_call_true_ms": bench_tool_calls,
    "idle_pss_mb": bench_idle_pss,
    "idle_guest_ram_pss_mb": bench_idle_pss,
    "idle_tcg_cache_pss_mb": bench_idle_pss,
    "idle_pss_ksm_mb": bench_idle_pss_ksm,  # a second node with AENV_KSM=on (bench/ksm.py)
    **{f"{op}_{mib}mib_ms": bench_pause_resume for op in ("pause", "resume", "resume_cold") for mib in (20, 200)},
    "snapshot_1gib_disk_ms": bench_snapshot_disk,
    "snapshot_idle_ms": bench_snapshot_disk,
    "fork16_ms": bench_fork,
    "fork_child_pss_mb": bench_fork,
    "reset_ms": bench_fork,
    "reset_cold_ms": bench_fork,
    "reset_group8_ms": bench_reset_group,
    "reset_group8_first_ms": bench_reset_group,
    **{f"migrate_{op}_{mib}mib_ms": bench_migrate_baseline for op in ("save", "load") for mib in (20, 200)},
    # issue #4: through the official E2B Python SDK (bench/e2b_sdk.py)
    "e2b_tti_ms": bench_e2b_tti,
    "e2b_tti_burst50_ms": bench_e2b_burst50,
    "e2b_exec_rtt_ms": bench_e2b_exec,
    "guest_bash_true_ms": bench_e2b_exec,
    "e2b_exec_server_cpu_ms": bench_e2b_exec,
    "upload_100mb_s": bench_e2b_transfer,
    "download_100mb_s": bench_e2b_transfer,
    # issue #5: templates from images (bench/images.py)
    "pull_convert_s": bench_pull,
    "pull_cached_s": bench_pull,
    "template_build_s": bench_template_build,
    "template_rebuild_cached_s": bench_template_build,
}
IMAGE_SCENARIOS = (bench_pull,)  # these get the image pushed to the bench's loopback registry
MACHINE_LEVEL = ("cold_boot_ms", "template_snapshot_ms", "create_coldboot_ms")


def run_bench(only: set[str] | None, runs: int, cache: Path = CACHE, accel: str = "auto") -> dict[str, object]:
    """Run the selected scenarios; returns the JSON report of ``aenv bench --json``."""
    metrics: Report = {}
    accel_info = detect_accel(accel)
    # Left by a benchmark killed earlier (SIGKILL: no teardown): its VMs and its address blocks.
    for pid in find_qemu_pids(os.path.join(tempfile.gettempdir(), "aenv-bench-")):
        kill_pid(pid)
    for cidr in (BENCH_CIDR, COLD_CIDR, MIGRATE_CIDR, KSM_CIDR):
        remove_slots_in(cidr)
    with tempfile.TemporaryDirectory(prefix="aenv-bench-") as tmpd:
        tmp = Path(tmpd)
        if only is None or only & set(MACHINE_LEVEL):
            raw = asyncio.run(_cold_boots(min(runs, 5), tmp, cache, accel))
            metrics.update({k: summarize(v) for k, v in raw.items() if only is None or k in only})
        wanted: list[Scenario] = []
        for name, fn in SCENARIOS.items():
            if (only is None or name in only) and fn not in wanted:
                wanted.append(fn)
        if wanted:
            registry = image = None
            if any(fn in IMAGE_SCENARIOS for fn in wanted):
                registry = LocalRegistry().start()
                image = make_pull_image(registry)
            defaults = Settings()  # the server as it runs by default (tests use smaller pools)
            node = LocalNode(tmp / "node", BENCH_CIDR, cache, AENV_POOL_SIZE=str(defaults.pool_size),
                             AENV_SLOT_POOL_SIZE=str(defaults.slot_pool_size), AENV_ACCEL=accel,
                             AENV_SNAPSHOT_POOL_SIZE=str(defaults.snapshot_pool_size),
                             AENV_MAX_SANDBOXES="64", AENV_DOMAIN=DOMAIN, AENV_PAUSE_LINGER_S=str(PAUSE_LINGER_S),
                             AENV_INSECURE_REGISTRIES=registry.host if registry else "")
            node.start()
            try:
                with node.client() as api:
                    _create(api)  # first create builds the template snapshot
                    for sb in api.get("/sandboxes").json():
                        api.delete(f"/sandboxes/{sb['sandboxID']}")
                    for fn in wanted:
                        # a scenario reports its baseline with it, asked for or not
                        raw = fn(node, api, runs, image) if fn in IMAGE_SCENARIOS else fn(node, api, runs)
                        metrics.update({k: summarize(v) for k, v in raw.items()})
            finally:
                node.kill_all()
                if registry is not None:
                    registry.stop()
    return {"accel": accel_info.accel, "accelReason": accel_info.reason,
            "guestCpu": accel_info.cpu_model(Settings.from_env().tcg_cpu),
            "backgroundNice": Settings.from_env().background_nice,
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                        "memoryGiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
            "metrics": metrics}
