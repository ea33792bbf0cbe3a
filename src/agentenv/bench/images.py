"""Benchmark scenarios of issue #5: a template from an OCI image, pulled from a docker-registry
on loopback (``bench/registry.py``), with the cached re-pull as the baseline of the same run."""

from __future__ import annotations

import shutil
import time

import httpx

from agentenv.bench.node import LocalNode
from agentenv.bench.registry import BuiltImage, LocalRegistry, build_debian_image

PULL_IMAGE_EXTRA_MB = 30  # the Debian tree compresses to ~70 MiB; with this the image is ~100 MiB


def make_pull_image(registry: LocalRegistry) -> BuiltImage:
    return build_debian_image(registry, "bench/debian", extra_mb=PULL_IMAGE_EXTRA_MB)


def bench_pull(node: LocalNode, api: httpx.Client, runs: int, image: BuiltImage) -> dict[str, list[float]]:
    """``POST /images/pull`` → 201 with an empty image cache (registry → OCI layout → ext4),
    then again with the same digest cached (manifest check only)."""
    cold, cached = [], []
    for i in range(max(1, min(runs, 5))):  # each cold pull moves ~100 MiB and writes a 4 GiB sparse ext4
        shutil.rmtree(node.data_dir / "images", ignore_errors=True)
        t0 = time.perf_counter()
        r = api.post("/images/pull", json={"image": image.ref, "name": f"bench-pull-{i}"}, timeout=1800)
        r.raise_for_status()
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        api.post("/images/pull", json={"image": image.ref, "name": f"bench-pull-{i}"}, timeout=1800).raise_for_status()
        cached.append(time.perf_counter() - t0)
    return {"pull_convert_s": cold, "pull_cached_s": cached}


def _build(api: httpx.Client, name: str, steps: list[dict]) -> float:
    """One build through E2B's build protocol (v3 request, v2 start, status polling as the SDK
    does every 0.2 s); seconds from the start request to ``ready``."""
    r = api.post("/v3/templates", json={"name": name})
    r.raise_for_status()
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    t0 = time.perf_counter()
    api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "base", "steps": steps}).raise_for_status()
    while True:
        st = api.get(f"/templates/{tid}/builds/{bid}/status").json()
        if st["status"] == "ready":
            return time.perf_counter() - t0
        if st["status"] == "error":
            raise RuntimeError(f"bench build {name} failed: {st.get('reason')}")
        time.sleep(0.2)


def _steps(nonce: str, last: str) -> list[dict]:
    """Three RUN steps as a user writes them: install-like work, a config file, the app step."""
    return [
        {"type": "RUN", "args": [f"mkdir -p /opt/app && seq 1 20000 > /opt/app/data-{nonce}.txt", "root"]},
        {"type": "RUN", "args": ["echo 'mode=bench' > /opt/app/app.conf && sha256sum /opt/app/*", "root"]},
        {"type": "RUN", "args": [f"echo '{last}' > /opt/app/version", "root"]},
    ]


def bench_template_build(node: LocalNode, api: httpx.Client, runs: int, image: BuiltImage | None = None) -> dict[str, list[float]]:
    """A 3-step build from ``base`` with nothing cached (a fresh first step each run), then the
    same build with only the last step changed (the first two restore from the layer cache)."""
    full, cached = [], []
    for i in range(max(1, min(runs, 5))):
        nonce = f"{time.time_ns()}-{i}"
        full.append(_build(api, f"bench-build-{i}", _steps(nonce, "v1")))
        cached.append(_build(api, f"bench-build-{i}", _steps(nonce, "v2")))
        api.delete(f"/templates/bench-build-{i}")
    return {"template_build_s": full, "template_rebuild_cached_s": cached}
