"""Benchmark scenarios of issue #4: what an E2B user sees, measured with the official E2B
Python SDK (2.63.0, unchanged) against the benchmark's node.

The SDK lives in its own virtualenv (installed by ``scripts/sdk-clients``), so each scenario
runs ``PROGRAM`` there as a subprocess, pointed at the node the way an E2B user points the SDK
at a self-hosted server (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``, ``E2B_DOMAIN``).
The program times inside itself (``time.perf_counter``), so Python startup and the SDK import
are not in any figure, and prints one JSON object of samples as its last line.

- ``e2b_tti_ms``: time to interactive, ``Sandbox.create()`` + ``commands.run("echo hi")``, one
  sandbox at a time (killed after, untimed), with the warm pool refilled before each run.
  ``max(runs * 5, 10)`` runs: the issue's 50 at ``--runs 10``.
- ``e2b_tti_burst50_ms``: 50 threads each doing create + ``echo hi`` at once; one sample per
  burst (until the last one has answered); ``max(1, min(3, runs // 4))`` bursts.
- ``e2b_exec_rtt_ms``: ``commands.run("true")`` on a live sandbox, ``max(runs * 10, 50)``
  samples; with its baseline ``guest_bash_true_ms``, the guest's own time for
  ``bash -l -c true`` (how envd runs a command), timed inside the guest 20 times; and
  ``e2b_exec_server_cpu_ms``, the server process's CPU time (its threads' run time, from
  ``/proc/PID/task/*/schedstat``) per such call, averaged over each 10 calls: the sandbox
  proxy's cost per command, which on a small host shares the cores with the emulated guest.
- ``upload_100mb_s`` / ``download_100mb_s``: seconds to ``files.write`` / ``files.read(format=
  "bytes")`` 100 MB (10^8 random bytes) to / from ``/home/user``; ``min(runs, 3)`` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import httpx

from agentenv.bench.node import LocalNode

SDK_CACHE = Path(os.environ.get("AENV_SDK_CACHE", "/var/lib/agentenv/cache/sdk-venvs"))
SDK_VERSION = "2.63.0"
DOMAIN = "aenv.test"  # the node is started with AENV_DOMAIN set to it (see run_bench)

PROGRAM = r'''
import json, os, shlex, sys, time
from concurrent.futures import ThreadPoolExecutor

import httpx
from e2b import Sandbox

mode, n = sys.argv[1], int(sys.argv[2])
URL = os.environ["E2B_API_URL"]


def wait_pool(timeout=60):
    """Let the node's warm pool refill, so a measurement does not share the CPU with restores."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        d = httpx.get(URL + "/health/details", headers={"X-API-Key": os.environ["E2B_API_KEY"]}).json()
        if d.get("poolReady", 0) >= d.get("poolSize", 0):
            return
        time.sleep(0.05)


def ms(t0):
    return (time.perf_counter() - t0) * 1000


def server_cpu_ms():
    """CPU time of the server's threads in ms, to the nanosecond (schedstat; /proc/PID/stat
    counts 10 ms ticks). A thread that ended meanwhile is not counted."""
    task = f"/proc/{os.environ['AENV_BENCH_SERVER_PID']}/task"
    total = 0
    for tid in os.listdir(task):
        try:
            total += int(open(f"{task}/{tid}/schedstat").read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e6


def tti():
    sb = Sandbox.create(timeout=300)
    r = sb.commands.run("echo hi")
    assert r.stdout.strip() == "hi", r
    return sb


out = {}
if mode == "tti":
    out["e2b_tti_ms"] = []
    for _ in range(n):
        wait_pool()
        t0 = time.perf_counter()
        sb = tti()
        out["e2b_tti_ms"].append(ms(t0))
        sb.kill()
elif mode == "burst":
    out["e2b_tti_burst50_ms"] = []
    for _ in range(n):
        wait_pool(120)
        with ThreadPoolExecutor(50) as ex:
            t0 = time.perf_counter()
            futures = [ex.submit(tti) for _ in range(50)]
            sbs, errors = [], []
            for f in futures:
                try:
                    sbs.append(f.result())
                except Exception as e:  # kill what was created before failing
                    errors.append(repr(e))
            dt = ms(t0)
            list(ex.map(lambda s: s.kill(), sbs))
        if errors:
            raise SystemExit(f"{len(errors)} of 50 failed: {errors[:3]}")
        out["e2b_tti_burst50_ms"].append(dt)
elif mode == "exec":
    wait_pool()
    sb = Sandbox.create(timeout=900)
    try:
        wait_pool()  # measure without the pool refilling on the other core
        sb.commands.run("true")  # first call opens the connection
        out["e2b_exec_rtt_ms"], out["e2b_exec_server_cpu_ms"] = [], []
        for i in range(n):
            if i % 10 == 0:
                cpu0 = server_cpu_ms()
            t0 = time.perf_counter()
            sb.commands.run("true")
            out["e2b_exec_rtt_ms"].append(ms(t0))
            if i % 10 == 9:
                out["e2b_exec_server_cpu_ms"].append((server_cpu_ms() - cpu0) / 10)
        script = ("import subprocess,time\nts=[]\nfor _ in range(20):\n t=time.perf_counter();"
                  " subprocess.run(['bash','-l','-c','true']); ts.append((time.perf_counter()-t)*1000)\n"
                  "print(*ts)")
        r = sb.commands.run("python3 -c " + shlex.quote(script), timeout=120)
        out["guest_bash_true_ms"] = [float(x) for x in r.stdout.split()]
    finally:
        sb.kill()
elif mode == "transfer":
    data = os.urandom(100_000_000)
    wait_pool()
    sb = Sandbox.create(timeout=1800)
    try:
        wait_pool()
        out["upload_100mb_s"], out["download_100mb_s"] = [], []
        for i in range(n):
            path = f"/home/user/bench-100mb-{i}.bin"
            t0 = time.perf_counter()
            sb.files.write(path, data, request_timeout=900)
            out["upload_100mb_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = sb.files.read(path, format="bytes", request_timeout=900)
            out["download_100mb_s"].append(time.perf_counter() - t0)
            assert len(back) == len(data) and back[:4096] == data[:4096] and back[-4096:] == data[-4096:]
            sb.commands.run(f"rm -f {path}")
    finally:
        sb.kill()
else:
    raise SystemExit(f"unknown mode {mode}")
print(json.dumps(out))
'''


def sdk_python(version: str = SDK_VERSION) -> Path:
    py = SDK_CACHE / f"py-{version}" / "bin" / "python"
    if not py.exists():
        raise RuntimeError(f"the E2B Python SDK {version} is not installed ({py} is missing): run `scripts/sdk-clients` "
                           f"(it installs into $AENV_SDK_CACHE, default {SDK_CACHE})")
    return py


def run_sdk(node: LocalNode, mode: str, n: int, timeout: float = 3600) -> dict[str, list[float]]:
    """Run ``PROGRAM`` in ``mode`` with the SDK against ``node``; its samples."""
    py = sdk_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(E2B_API_KEY=node.api_key, E2B_API_URL=node.url, E2B_SANDBOX_URL=node.url, E2B_DOMAIN=DOMAIN)
    assert node.proc is not None
    env["AENV_BENCH_SERVER_PID"] = str(node.proc.pid)  # (setpriv execs the server: the same process)
    with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="aenv-bench-e2b-") as f:
        f.write(PROGRAM)
        f.flush()
        r = subprocess.run([str(py), f.name, mode, str(n)], env=env, capture_output=True, text=True,
                           timeout=timeout, check=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"E2B SDK benchmark {mode!r} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n"
                           f"{r.stderr[-4000:]}")
    return {k: [float(x) for x in v] for k, v in json.loads(lines[-1]).items()}


def bench_e2b_tti(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    return run_sdk(node, "tti", max(runs * 5, 10))


def bench_e2b_burst50(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    return run_sdk(node, "burst", max(1, min(3, runs // 4)))


def bench_e2b_exec(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    return run_sdk(node, "exec", max(runs * 10, 50))


def bench_e2b_transfer(node: LocalNode, api: httpx.Client, runs: int) -> dict[str, list[float]]:
    return run_sdk(node, "transfer", min(runs, 3))
