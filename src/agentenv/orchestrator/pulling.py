"""Templates from OCI images: pull (``images.oci``), convert to a read-only ext4 base, register.

The template shares the kernel, initramfs and tools drive of the default template; only its
base image differs. Its first sandbox cold-boots it once per shape (as for any template) and
every later one is a restore. The image's config (Env, WorkingDir, User, Entrypoint, Cmd) is
recorded with the template; Env, WorkingDir and User become the defaults of its sandboxes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.errors import InvalidRequest
from agentenv.images import GuestArtifacts, oci
from agentenv.images.artifacts import remove_read_only
from agentenv.images.registry import ImageRef, parse_reference
from agentenv.orchestrator.templates import Template

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)

TEMPLATE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
RESERVED = {"base"}  # the default template is `aenv setup`'s, not a pull's
BUILD_BASE_PREFIX = "from-image."  # images template builds start from (build_base_name)
DEFAULT_DISK_MB = 4096
MAX_DISK_MB = 65536


def default_name(ref: ImageRef) -> str:
    """``docker.io/library/ubuntu:22.04`` → ``ubuntu``: the last path component."""
    return ref.repository.rsplit("/", 1)[-1].lower()


def build_base_name(orch: Orchestrator, image: str) -> str:
    """The catalog name of an image a template build starts ``FROM``: one of its own, named
    after the whole reference. Under the image's default name, a build named like its image
    (``myapp`` from ``org/myapp:1``) was shadowed by it (creates took the bare image), two
    builds from ``a/app`` and ``b/app`` shared one name, and a user's template of that name
    was replaced."""
    ref = parse_reference(image, default_registry=orch.registry.default_registry)
    digest = hashlib.sha256(str(ref).encode()).hexdigest()[:10]
    return f"{BUILD_BASE_PREFIX}{default_name(ref)[:40]}-{digest}"


def _default_user(config: oci.ImageConfig) -> str:
    """E2B's default user is ``user`` (the conversion adds it); an image that names a non-root
    user of its own keeps it."""
    user = (config.user or "").split(":", 1)[0]
    return user if user and user not in ("root", "0") else "user"


async def pull(orch: Orchestrator, image: str, *, name: str | None = None, username: str | None = None,
               password: str | None = None, disk_mb: int | None = None) -> Template:
    ref = parse_reference(image, default_registry=orch.registry.default_registry)
    name = name or default_name(ref)
    if not TEMPLATE_NAME.fullmatch(name):
        raise InvalidRequest(f"template name '{name}' is invalid: use 1-64 lowercase letters, digits, '.', '_' "
                             "or '-', starting with a letter or digit (pass one with --name)")
    if name in RESERVED:
        raise InvalidRequest(f"template name '{name}' is reserved for the default template; pass another name")
    size = DEFAULT_DISK_MB if disk_mb is None else disk_mb
    if not 512 <= size <= MAX_DISK_MB:
        raise InvalidRequest(f"diskSizeMB must be between 512 and {MAX_DISK_MB}, got {size}")
    # What earlier pulls left that no template uses (a conversion refused as too large keeps
    # its download): each pull clears it, not only a template's deletion.
    await clean_unused_images(orch, starting_pull=True)
    try:
        return await _pull(orch, ref, name, size, username, password)
    finally:
        orch.pulls_in_progress -= 1
        if orch.pulls_in_progress == 0 and orch.image_cleanup_wanted:
            try:
                await clean_unused_images(orch)
            except Exception:  # noqa: BLE001 — the pull's own outcome stands
                log.exception("removing unused images after the last pull failed")


async def clean_unused_images(orch: Orchestrator, *, starting_pull: bool = False) -> None:
    """``remove_unused_images``, once no pull is in progress: what a pull downloads or reuses
    is used by no template until it registers one (and it may run for longer than any age
    that would tell). One asked for meanwhile runs when the last pull ends. Pulls start only
    once a clean-up in progress is done (``starting_pull``: the caller is one, counted here)."""
    async with orch.image_gate:
        if orch.pulls_in_progress == 0:
            orch.image_cleanup_wanted = False
            await asyncio.to_thread(remove_unused_images, orch)
        else:
            orch.image_cleanup_wanted = True
        if starting_pull:
            orch.pulls_in_progress += 1


async def _pull(orch: Orchestrator, ref: ImageRef, name: str, size: int, username: str | None,
                password: str | None) -> Template:
    base = orch.catalog.get("base").artifacts
    root = orch.settings.data_dir / "images"
    t0 = time.monotonic()
    pulled = await oci.pull(ref, root, orch.registry, username=username, password=password)
    out = root / "rootfs" / oci.ext4_name(pulled, size)
    async with orch.image_lock(str(out)):
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            await oci.to_ext4(pulled, out, size_mb=size)
        else:  # in use again: fresh for remove_unused_images until it is registered below
            await asyncio.to_thread(os.utime, out)
    cfg = pulled.config
    template = Template(
        name=name, artifacts=GuestArtifacts(kernel=base.kernel, initramfs=base.initramfs, rootfs=out, tools=base.tools),
        disk_mb=size, image={"ref": str(pulled.ref), "digest": pulled.digest, "config": cfg.to_json()},
        env=dict(cfg.env), user=_default_user(cfg), workdir=cfg.workdir or None, created_at=time.time(),
    )
    before = await asyncio.to_thread(lambda: orch.catalog.get(name) if orch.catalog.exists(name) else None)
    await asyncio.to_thread(orch.catalog.put, template)
    log.info("template %s from %s (%s) in %.1f s", name, pulled.ref, pulled.digest[:19], time.monotonic() - t0)
    if before is not None and replace(before, created_at=template.created_at) != template:
        # An update: the next create starts from the new image (its snapshot is new: the
        # builder names snapshots after their inputs); the old one's go as after a delete.
        log.info("template %s now comes from %s; the previous image's ready sandboxes go", name, pulled.ref)
        await orch.retire_template_snapshots(name)
    return template


# What a pull or conversion cut short (a server killed meanwhile) leaves in the image cache:
# downloads and unpacked trees (GiBs), a half-made ext4, and an auth file with registry
# credentials in it. Their owners' ``finally`` never ran; no live pull exists at start.
INTERRUPTED = ("oci/.pull-*", "oci/.unpack-*", "oci/.auth-*", "oci/.drop-*", "rootfs/.*.partial")


def remove_interrupted(images_dir: Path) -> list[str]:
    """At start: delete what interrupted pulls and conversions left (``INTERRUPTED``)."""
    removed = []
    for pattern in INTERRUPTED:
        for p in images_dir.glob(pattern):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(str(p))
    for path in removed:
        log.warning("removed %s, left by a pull that was interrupted", path)
    return removed


def _older(path: Path, than: float) -> bool:
    try:
        return path.stat().st_mtime < than
    except FileNotFoundError:  # (removed meanwhile)
        return False


def remove_unused_images(orch: Orchestrator) -> list[str]:
    """Delete converted images (ext4) and OCI layouts that no template uses any more. A base
    image stays while a template snapshot built on it exists (a running sandbox's disk chain
    ends in it; such snapshots go with ``SnapshotBuilder.remove_stale`` once unused)."""
    root = orch.settings.data_dir / "images"
    in_use = {str(t.artifacts.rootfs) for t in orch.catalog.list()}
    for meta in orch.snapshots.root.glob("*/snapshots/*/meta.json"):
        try:
            in_use.add(json.loads(meta.read_text())["rootfs"])
        except (OSError, ValueError, KeyError):
            continue
    digests = {(t.image or {}).get("digest", "") for t in orch.catalog.list()}
    fresh = time.time() - 600  # (callers hold off while a pull runs; this spares one of another server)
    removed = []
    for ext4 in (root / "rootfs").glob("*.ext4"):
        if str(ext4) not in in_use and _older(ext4, fresh):
            remove_read_only(ext4)
            removed.append(str(ext4))
    for layout in (root / "oci").glob("[0-9a-f]*"):
        if f"sha256:{layout.name}" not in digests and _older(layout, fresh):
            shutil.rmtree(layout, ignore_errors=True)
            removed.append(str(layout))
    for path in removed:
        log.info("removed unused image %s", path)
    return removed
