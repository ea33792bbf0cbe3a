"""KSM (AENV_KSM=on): identical pages of different sandboxes end up as one host page, and the
sandboxes neither see nor lose anything by it. Off by default: then no QEMU is mergeable.

The test speeds up the host's ksmd for its duration (its knobs are host-wide) and puts them
back afterwards.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.bench import ksm as bench_ksm
from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess

# 8 MiB of the same pseudo-random bytes in each guest's tmpfs (guest RAM): pages no template
# holds, equal across the sandboxes and nowhere else.
SAME = ("python3 -c \"import random; random.seed(7); "
        "open('/dev/shm/same', 'wb').write(random.randbytes(8 << 20))\"")
SAME_MD5 = hashlib.md5(__import__("random").Random(7).randbytes(8 << 20)).hexdigest()


def _ksm_stat(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/ksm_stat").read_text().splitlines()
    return dict(line.split(": ", 1) if ": " in line else line.split(" ", 1) for line in lines)


@pytest.fixture
def fast_ksmd() -> Iterator[None]:
    with bench_ksm.host_ksmd_settings_kept():
        bench_ksm.scan_fast()
        yield


def test_ksm_merges_equal_pages_of_sandboxes(tmp_path: Path, fast_ksmd: None) -> None:
    s = ServerProcess(tmp_path / "data", node_cidr(28), AENV_POOL_SIZE="0", AENV_KSM="on")
    s.start()
    try:
        with s.client() as api:
            ksm = api.get("/health/details").json()["ksm"]
            assert ksm["enabled"] is True and ksm["ksmdRunning"] is True, ksm
            sids = [api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
                    for _ in range(3)]
            pids = {sid: next(iter(host.qemu_pids(sid))) for sid in sids}
            for sid in sids:
                assert _ksm_stat(pids[sid])["ksm_merge_any"] == "yes"
                run(api, sid, SAME, timeout=120)
            # each QEMU ends up with (nearly) all 2,048 pages of the file merged
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                merged = {sid: int(_ksm_stat(pid)["ksm_merging_pages"]) for sid, pid in pids.items()}
                if min(merged.values()) >= 1800:
                    break
                time.sleep(1)
            assert min(merged.values()) >= 1800, merged
            assert api.get("/health/details").json()["ksm"]["pagesSharing"] >= 1800
            # the guests read what they wrote, and writing a merged page is private to its guest
            for sid in sids:
                assert run(api, sid, "md5sum /dev/shm/same")["stdout"].split()[0] == SAME_MD5
            run(api, sid=sids[0], cmd="printf changed | dd of=/dev/shm/same conv=notrunc status=none")
            assert run(api, sids[0], "head -c 7 /dev/shm/same")["stdout"] == "changed"
            for sid in sids[1:]:
                assert run(api, sid, "md5sum /dev/shm/same")["stdout"].split()[0] == SAME_MD5
            for sid in sids:
                assert api.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        s.kill_all()


def test_qemu_is_not_mergeable_by_default(api: httpx.Client, sandbox: str) -> None:
    assert api.get("/health/details").json()["ksm"]["enabled"] is False
    (pid,) = host.qemu_pids(sandbox)
    assert _ksm_stat(pid)["ksm_merge_any"] == "no"
