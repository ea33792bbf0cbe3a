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
