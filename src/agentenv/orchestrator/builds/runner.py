"""Template builds: run a build's steps in a temporary sandbox and snapshot it, with memory,
as a named template whose sandboxes start with the start command already running.

    base (template snapshot, a built template, or a pulled image)
      → longest cached prefix of steps (a ``build-step`` checkpoint per RUN/COPY)
      → the remaining steps through the guest agent, a checkpoint after each RUN/COPY
      → /init with the template's env, user and workdir → start command (tag "start")
      → ready command polled until it exits 0 → checkpoint ``template`` named after it
      → the temporary sandbox is killed, whatever happened.

See docs/mechanisms/template-builds.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.errors import (
    AgentenvError,
    InvalidRequest,
    NotFound,
    SandboxNotFound,
    SnapshotUnusable,
)
from agentenv.orchestrator import pulling
from agentenv.orchestrator.builds import tags
from agentenv.orchestrator.builds.records import (
    ACTIVE,
    LEVELS,
    BuildFiles,
    BuildRecord,
    LogEntry,
    TemplateEntry,
)
from agentenv.orchestrator.builds.spec import (
    CHECKPOINTED,
    BuildSpec,
    Config,
    parse_spec,
    split_name,
)
from agentenv.orchestrator.builds.steps import TAIL_LINES, GuestSteps, StepFailed
from agentenv.orchestrator.lifecycle import State
from agentenv.storage import Checkpoint

if TYPE_CHECKING:
    from agentenv.orchestrator.service import Orchestrator

log = logging.getLogger(__name__)

STEP_KIND = "build-step"  # repository checkpoints of the layer cache (not listed anywhere)
TEMPLATE_KIND = "template"  # a built template's checkpoint, named after the template
BUILD_META = "agentenv.build"  # metadata key marking a build's temporary sandbox
MAX_LOG_ENTRIES = 20000
LOG_TRUNCATED = f"(the build log is cut here: more than {MAX_LOG_ENTRIES} lines; further output is not kept)"


class BuildNotFound(NotFound):
    def __init__(self, template_id: str, build_id: str) -> None:
        super().__init__(f"build '{build_id}' of template '{template_id}' not found")


class BuiltTemplateNotFound(NotFound):
    def __init__(self, template_id: str) -> None:
        super().__init__(f"template '{template_id}' not found; `aenv template ls` lists the templates")


@dataclass
class Base:
    """Where a build starts: a catalog template in a shape, or a checkpoint (a built template)."""

    name: str
    identity: dict[str, Any]
    vcpus: int
    memory_mb: int
    checkpoint: Checkpoint | None = None


class Builds(GuestSteps):
    """Build requests, running builds, their records and the built templates of one node."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        data = orch.settings.data_dir
        self.files = BuildFiles(data / "builds")
        self.uploads = data / "build-files"
        self.uploads.mkdir(parents=True, exist_ok=True)
        self._builds: dict[str, BuildRecord] = {b.build_id: b for b in self.files.builds()}
        self._templates: dict[str, TemplateEntry] = {t.template_id: t for t in self.files.templates()}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()  # builds stopped because their template was deleted
        self._truncated: set[str] = set()  # running builds whose log got its truncation notice
        self._saved_at: dict[str, float] = {}
        self._sem: asyncio.Semaphore | None = None

    # -- start / stop ---------------------------------------------------------------------

    async def start(self) -> None:
        """After recovery: builds cut short by a restart become errors and their sandboxes go."""
        for b in self._builds.values():
            if b.status == "building":
                b.status = "error"
                b.reason = {"message": "server restarted during the build", "step": "finalize"}
                self._log(b, "server restarted during the build", level="error")
                b.finished_at = time.time()
                b.sandbox_id = None
                self._save(b)
        for rec in self.orch.list():
            if BUILD_META in rec.metadata:
                log.info("killing sandbox %s of interrupted build %s", rec.id, rec.metadata[BUILD_META])
                try:
                    await self.orch.kill(rec.id)
                except SandboxNotFound:
                    pass
        # Uploads a crash cut short (up to AENV_BUILD_UPLOAD_MAX_MB each; none is in progress yet).
        for part in self.uploads.glob(".*.part") if self.uploads.is_dir() else ():
            part.unlink(missing_ok=True)
            log.info("removed interrupted upload %s", part.name)
        await self._prune()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):  # cancelled or failed: recorded by the task
                await t

    # -- requests -------------------------------------------------------------------------

    def request(self, name: str, *, tags: list[str] | None = None, vcpus: int | None = None,
                memory_mb: int | None = None) -> BuildRecord:
        """``POST /v3/templates``: a new build (status ``waiting``) of template ``name``."""
        template_id, name_tags = split_name(name)
        if self.orch.catalog.exists(template_id):
            raise InvalidRequest(f"'{template_id}' is a built-in template; choose another name for a build")
        if any(cp.name == template_id for cp in self.orch.repo.list("snapshot")):
            raise InvalidRequest(f"'{template_id}' is the name of a snapshot; choose another template name")
        s = self.orch.settings
        if vcpus is not None and not 1 <= vcpus <= s.max_vcpus:
            raise InvalidRequest(f"cpuCount must be between 1 and {s.max_vcpus}, got {vcpus}")
        if memory_mb is not None and (not 128 <= memory_mb <= s.max_memory_mb or memory_mb % 2):
            raise InvalidRequest(f"memoryMB must be an even number between 128 and {s.max_memory_mb}, got {memory_mb}")
        b = BuildRecord(build_id=str(uuid.uuid4()), template_id=template_id, vcpus=vcpus, memory_mb=memory_mb,
                        tags=[*name_tags, *(tags or [])])
        self._builds[b.build_id] = b
        self._save(b)
        return b

    def start_build(self, template_id: str, build_id: str, body: dict[str, Any]) -> BuildRecord:
        """``POST /v2/templates/{id}/builds/{buildID}``: check the spec, run it in the background."""
        b = self.build(template_id, build_id)
        if b.status != "waiting":
            raise InvalidRequest(f"build '{build_id}' was already started (it is {b.status}); request a new build")
        spec = parse_spec(body)
        b.spec = spec.to_json()
        b.status = "building"
        self._log(b, f"Build {b.build_id} of template '{b.template_id}' started")
        self._save(b)
        task = asyncio.get_running_loop().create_task(self._run(b, spec), name=f"build-{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(build_id, None))
        return b

    def build(self, template_id: str, build_id: str) -> BuildRecord:
        b = self._builds.get(build_id)
        if b is None or b.template_id != template_id:
            raise BuildNotFound(template_id, build_id)
        return b

    def builds_of(self, template_id: str) -> list[BuildRecord]:
        return [b for b in self._builds.values() if b.template_id == template_id]

    @staticmethod
    def entries(b: BuildRecord, offset: int = 0, limit: int = 100, level: str | None = None) -> list[LogEntry]:
        logs = b.logs
        if level:
            if level not in LEVELS:
                raise InvalidRequest(f"level must be one of {', '.join(LEVELS)}")
            lo = LEVELS.index(level)
            logs = [e for e in logs if LEVELS.index(e.level) >= lo]
        if offset < 0 or limit < 0:
            raise InvalidRequest("logsOffset and limit must be 0 or more")
        return logs[offset: offset + limit]

    # -- built templates ------------------------------------------------------------------

    def templates(self) -> list[TemplateEntry]:
        return list(self._templates.values())

    def template(self, template_id: str) -> TemplateEntry:
        t = self._templates.get(template_id)
        if t is None:
            raise BuiltTemplateNotFound(template_id)
        return t

    def exists(self, template_id: str) -> bool:
        return template_id in self._templates

    def put_template(self, t: TemplateEntry) -> None:
        """Record a changed entry of a built template (its tags: builds/tags.py)."""
        self.files.put_template(t)
        self._templates[t.template_id] = t

    def pending(self) -> list[BuildRecord]:
        """First builds of templates that do not exist yet (listed as building / error)."""
        latest: dict[str, BuildRecord] = {}
        for b in self._builds.values():
            if b.template_id not in self._templates and (
                    b.template_id not in latest or b.created_at > latest[b.template_id].created_at):
                latest[b.template_id] = b
        return list(latest.values())

    async def delete_template(self, template_id: str) -> None:
        """Remove a built template; sandboxes started from it keep running (their records pin
        its layers), and its cache entries go once nothing references them."""
        t = self._templates.get(template_id)
        if t is None and not self.builds_of(template_id):
            raise BuiltTemplateNotFound(template_id)
        # A build in progress is cancelled: its sandbox is killed as after any failed build.
        running = {b.build_id: self._tasks[b.build_id] for b in self.builds_of(template_id)
                   if b.status in ACTIVE and b.build_id in self._tasks}
        self._cancelled.update(running)
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        self._cancelled.difference_update(running)
        if t is not None:
            self._templates.pop(template_id, None)
            self.files.delete_template(template_id)
            self.orch.repo.delete(t.checkpoint)
        for b in self.builds_of(template_id):
            self._builds.pop(b.build_id, None)
            self.files.delete_build(b.build_id)
        await self._prune()

    # -- uploaded files (COPY) ------------------------------------------------------------

    def upload_path(self, files_hash: str) -> Path:
        from agentenv.orchestrator.builds.spec import FILES_HASH

        if not FILES_HASH.fullmatch(files_hash):
            raise InvalidRequest("the files hash must be 8-128 letters, digits, '-' or '_'")
        return self.uploads / files_hash

    def has_upload(self, files_hash: str) -> bool:
        return self.upload_path(files_hash).is_file()

    async def store_upload(self, files_hash: str, chunks: AsyncIterator[bytes], limit: int) -> int:
        """Stream an upload to ``<data>/build-files/<hash>`` (temp, then linked into place:
        of two uploads of one hash at once the first kept, never replaced); refuse more than
        ``limit`` bytes."""
        dest = self.upload_path(files_hash)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        size = 0
        try:
            f = await asyncio.to_thread(open, tmp, "wb")
            try:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise InvalidRequest(f"the upload is larger than the limit of {limit >> 20} MiB "
                                             "(AENV_BUILD_UPLOAD_MAX_MB)")
                    await asyncio.to_thread(f.write, chunk)
            finally:
                await asyncio.to_thread(f.close)
            with contextlib.suppress(FileExistsError):  # another upload of the hash came first
                await asyncio.to_thread(os.link, tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return size

    # -- records --------------------------------------------------------------------------

    def _log(self, b: BuildRecord, message: str, *, level: str = "info", step: str | None = None) -> None:
        # The SDKs poll by absolute offset: entries are never dropped from the front (that
        # shifted every offset, and they skipped lines, the final one among them). Past the
        # cap a step's output stops being kept, once noted; errors and the finalize lines
        # (the build's outcome) still are, up to a hard bound.
        if len(b.logs) >= MAX_LOG_ENTRIES:
            important = level == "error" or step in ("finalize", "base")
            if not important or len(b.logs) >= MAX_LOG_ENTRIES + 1000:
                if b.build_id not in self._truncated:  # once
                    self._truncated.add(b.build_id)
                    b.logs.append(LogEntry(time.time(), LOG_TRUNCATED, "warn", step))
                return
        b.logs.append(LogEntry(time.time(), message, level, step))
        # Saved (on the loop) at most once a second, and less often as the log grows: a save
        # writes the whole log, 20,000 lines took 200 ms. The API answers from memory; the
        # file is for a restart.
        if time.monotonic() - self._saved_at.get(b.build_id, 0.0) >= max(1.0, len(b.logs) / 2000):
            self._save(b)

    def _save(self, b: BuildRecord) -> None:
        self._saved_at[b.build_id] = time.monotonic()
        try:
            self.files.put_build(b)
        except OSError as exc:
            log.error("could not save build record %s: %s", b.build_id, exc)

    # -- the build ------------------------------------------------------------------------

    async def _run(self, b: BuildRecord, spec: BuildSpec) -> None:
        sid: str | None = None
        at = "base"  # the step a platform error is reported at
        t0 = time.monotonic()
        try:
            if self._sem is None:
                self._sem = asyncio.Semaphore(self.orch.settings.max_builds)
            async with self._sem:
                base = await self._base(b, spec)
                keys = spec.cache_keys({**base.identity, "shape": [base.vcpus, base.memory_mb]})
                final_key = hashlib.sha256(json.dumps(
                    [keys[-1] if keys else base.identity, base.vcpus, base.memory_mb, spec.start_cmd,
                     spec.ready_cmd]).encode()).hexdigest()
                if await self._reuse_final(b, spec, final_key):
                    return
                configs = spec.configs()
                start_at, cached = -1, None
                for i in reversed(range(spec.reusable_until())):
                    if spec.steps[i].type in CHECKPOINTED and (cp := self._cached(keys[i])) is not None:
                        start_at, cached = i, cp
                        break
                try:
                    sid = await self._sandbox(b, base, cached)
                except SnapshotUnusable as exc:  # a cache entry that cannot be restored: drop it
                    if cached is None:  # the base itself (a built template) cannot be restored
                        raise StepFailed(f"base template '{base.name}': {exc.message}", "base") from None
                    self._log(b, f"cache entry unusable ({exc.message}); building without it", level="warn")
                    self.orch.repo.delete(cached.id)
                    start_at, cached = -1, None
                    sid = await self._sandbox(b, base, None)
                b.sandbox_id = sid
                self._log(b, f"running in sandbox {sid}", level="debug", step="base")
                self._save(b)
                shell = await self._shell(sid)
                n = len(spec.steps)
                cfg = Config()
                ensured: set[str] = set()
                for i, step in enumerate(spec.steps):
                    at = str(i + 1)
                    label = f"[{i + 1}/{n}] {step.describe()}"
                    if i <= start_at:
                        cfg = configs[i]
                        if step.type in CHECKPOINTED and (cp := self._cached(keys[i])) is not None:
                            b.cache.append(cp.id)
                        self._log(b, f"CACHED {label}", step=str(i + 1))
                        continue
                    self._log(b, label, step=str(i + 1))
                    ts = time.monotonic()
                    await self._step(b, sid, i, step, cfg, shell, ensured)
                    cfg = configs[i]
                    if step.type in CHECKPOINTED:
                        cp = await self._checkpoint(sid, STEP_KIND, keys[i])
                        b.cache.append(cp.id)
                        self._log(b, f"step {i + 1} done in {time.monotonic() - ts:.1f}s (cached as {cp.id})",
                                  level="debug", step=str(i + 1))
                at = "finalize"
                await self._finalize(b, sid, spec, cfg, shell, ensured, final_key)
                b.status = "ready"
                self._log(b, f"Build finished in {time.monotonic() - t0:.1f}s: template '{b.template_id}' "
                             f"(build {b.build_id}) is ready", step="finalize")
        except StepFailed as exc:
            self._error(b, exc.message, exc.step)
        except asyncio.CancelledError:
            if b.build_id in self._cancelled:
                self._error(b, "build cancelled: its template was deleted", at)
            else:
                self._error(b, "server restarted during the build", "finalize")
            raise
        except AgentenvError as exc:  # e.g. a full disk while a step's checkpoint is saved
            self._error(b, exc.message, at)
        except Exception as exc:
            log.exception("build %s failed", b.build_id)
            self._error(b, f"internal error: {exc!r}", "finalize")
        finally:
            if sid is not None:
                try:
                    await self.orch.kill(sid)
                except SandboxNotFound:
                    pass
                except Exception:
                    log.exception("build %s: could not kill its sandbox %s", b.build_id, sid)
            b.sandbox_id = None
            b.finished_at = time.time()
            self._save(b)
            self._tasks.pop(b.build_id, None)
            self._truncated.discard(b.build_id)
            try:
                await self._prune()
            except Exception:
                log.exception("build cache prune failed")

    def _error(self, b: BuildRecord, message: str, step: str) -> None:
        b.status = "error"
        b.reason = {"message": message, "step": step}
        self._log(b, message, level="error", step=step)
        log.info("build %s of %s failed: %s", b.build_id, b.template_id, message)

    async def _base(self, b: BuildRecord, spec: BuildSpec) -> Base:
        orch = self.orch
        if spec.from_image:
            self._log(b, f"Pulling image {spec.from_image}", step="base")
            kw = {"username": spec.registry.username, "password": spec.registry.password} if spec.registry else {}
            t = await orch.pull(spec.from_image, name=pulling.build_base_name(orch, spec.from_image), **kw)
            name = t.name
        else:
            try:  # E2B's fromTemplate may name a tag: "name:tag"
                name = tags.resolve(spec.from_template or "base", self, orch.catalog)
            except NotFound as exc:
                raise StepFailed(f"base template: {exc}", "base") from None
        if orch.catalog.exists(name):
            t = orch.catalog.get(name)
            v, m = orch.validate_shape(t, b.vcpus, b.memory_mb)
            snap = await orch.snapshots.get(t, v, m)
            self._log(b, f"FROM {name} ({v} vCPU, {m} MiB)", step="base")
            return Base(name, {"template": name, "snapshot": str(snap.dir), "built": snap.created_at}, v, m)
        entry = self._templates.get(name)
        try:
            cp = orch.repo.get(entry.checkpoint if entry else name)
        except NotFound:
            raise StepFailed(f"base template '{name}' not found", "base") from None
        if cp.kind not in (TEMPLATE_KIND, "snapshot"):
            raise StepFailed(f"base template '{name}' not found", "base")
        if (b.vcpus and b.vcpus != cp.vcpus) or (b.memory_mb and b.memory_mb != cp.memory_mb):
            self._log(b, f"the shape of a build on '{name}' is its own ({cp.vcpus} vCPU, {cp.memory_mb} MiB); "
                         "cpuCount/memoryMB ignored", level="warn", step="base")
        self._log(b, f"FROM {name} (checkpoint {cp.id})", step="base")
        return Base(name, {"checkpoint": cp.id}, cp.vcpus, cp.memory_mb, cp)

    def _cached(self, key: str) -> Checkpoint | None:
        for cp in self.orch.repo.list(STEP_KIND):
            if cp.name == key:
                return cp
        return None

    async def _sandbox(self, b: BuildRecord, base: Base, cached: Checkpoint | None) -> str:
        orch = self.orch
        meta = {BUILD_META: b.build_id}
        timeout = orch.settings.max_timeout_s
        cp = cached or base.checkpoint
        if cp is None:
            rec = await orch.create(base.name, vcpus=base.vcpus, memory_mb=base.memory_mb, timeout_s=timeout,
                                    metadata=meta)
        else:
            from agentenv.orchestrator.forking import _new_sandbox

            async with orch.admitted(starting=cp):
                rec = await _new_sandbox(orch, cp, template=b.template_id, env_vars={}, metadata=meta,
                                         timeout_s=timeout, options={})
        log.info("build %s runs in sandbox %s", b.build_id, rec.id)
        return rec.id

    async def _checkpoint(self, sid: str, kind: str, name: str | None) -> Checkpoint:
        from agentenv.orchestrator.forking import _checkpoint

        return await _checkpoint(self.orch, self.orch._live[sid], State.SNAPSHOTTING, kind, name)

    async def _reuse_final(self, b: BuildRecord, spec: BuildSpec, final_key: str) -> bool:
        """An identical rebuild (same base, steps, start and ready commands; nothing forced):
        the template's checkpoint is published again under the new build id, if its layers
        are whole (a host crash may have damaged them: then the build runs, and repairs it)."""
        old = self._templates.get(b.template_id)
        if old is None or old.final_key != final_key or spec.force or spec.reusable_until() < len(spec.steps):
            return False
        try:
            cp = self.orch.repo.get(old.checkpoint)
            await asyncio.to_thread(self.orch.repo.verify, cp)
        except NotFound:
            return False
        except SnapshotUnusable as exc:
            self._log(b, f"the template's last build is unusable ({exc.message}); building it again",
                      level="warn", step="base")
            return False
        for i, step in enumerate(spec.steps):
            self._log(b, f"CACHED [{i + 1}/{len(spec.steps)}] {step.describe()}", step=str(i + 1))
        self._log(b, "CACHED finalize: nothing changed since build " + old.build_id, step="finalize")
        b.cache = list(old.cache)
        self._publish(b, spec, cp, Config(env=dict(old.env)), final_key)
        b.status = "ready"
        self._log(b, f"Build finished: template '{b.template_id}' (build {b.build_id}) is ready", step="finalize")
        return True

    async def _finalize(self, b: BuildRecord, sid: str, spec: BuildSpec, cfg: Config, shell: str,
                        ensured: set[str], final_key: str) -> None:
        step = "finalize"
        envd = self.orch.envd(sid)
        await self._ensure_workdir(sid, cfg, ensured)
        # The agent keeps these in memory: the memory snapshot carries them to every sandbox.
        await envd.configure(env_vars=cfg.env, default_user=cfg.user, default_workdir=cfg.workdir)
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        drain: asyncio.Task[None] | None = None
        ended: dict[str, Any] = {}
        try:
            if spec.start_cmd:
                self._log(b, f"Starting: {spec.start_cmd}", step=step)
                drain = await self._start(b, sid, spec.start_cmd, cfg, shell, tail, ended)
            if spec.ready_cmd:
                await self._wait_ready(b, sid, spec, cfg, shell, ended, tail)
            elif drain is not None:
                await asyncio.sleep(1.0)  # let it get going; its state is in the memory snapshot either way
            if "exit_code" in ended:
                raise StepFailed(f"the start command exited (code {ended['exit_code']}) before the snapshot; "
                                 "last output:\n" + ("\n".join(tail) or "(no output)"), step)
        finally:
            if drain is not None:
                drain.cancel()
                with contextlib.suppress(BaseException):
                    await drain
        self._log(b, "Snapshotting the sandbox (memory, processes and disk)", step=step)
        # Captured under no name: creates find a template's checkpoint by its name, and this
        # one's manifest holds the build sandbox's metadata (a build's marker: the next start
        # kills such sandboxes) until it is rewritten below, seconds later for large layers.
        cp = await self._checkpoint(sid, TEMPLATE_KIND, None)
        cp = cp.with_(name=b.template_id, env_vars=dict(cfg.env), metadata={}, default_user=cfg.user,
                      default_workdir=cfg.workdir)
        # Layers on disk before the manifest that names them (a host crash must not leave a
        # durable template over layers still in the page cache).
        await asyncio.to_thread(self.orch.repo.put_durably, cp)
        self._publish(b, spec, cp, cfg, final_key)
        await self.orch.gc()

    def _publish(self, b: BuildRecord, spec: BuildSpec, cp: Checkpoint, cfg: Config, final_key: str) -> None:
        now = time.time()
        old = self._templates.get(b.template_id)
        entry = TemplateEntry(
            template_id=b.template_id, build_id=b.build_id, checkpoint=cp.id, vcpus=cp.vcpus,
            memory_mb=cp.memory_mb, disk_mb=cp.disk_mb, created_at=old.created_at if old else now,
            updated_at=now, build_count=(old.build_count + 1) if old else 1, start_cmd=spec.start_cmd,
            ready_cmd=spec.ready_cmd, env=dict(cfg.env), tags=sorted(set(b.tags) | {"default"}),
            cache=list(b.cache), final_key=final_key,
        )
        self.files.put_template(entry)
        self._templates[b.template_id] = entry
        if old is not None and old.checkpoint != cp.id:
            self.orch.repo.delete(old.checkpoint)  # sandboxes of the old build keep its layers pinned
        # any older manifest of the same name (a crash between publish and delete)
        for other in self.orch.repo.list(TEMPLATE_KIND):
            if other.name == b.template_id and other.id != cp.id:
                self.orch.repo.delete(other.id)

    async def _prune(self) -> None:
        """Drop cache entries nothing needs: kept are those of every built template's build,
        of the latest build of each template (so a retry after a failure reuses its steps)
        and of running builds."""
        keep: set[str] = set()
        for t in self._templates.values():
            keep |= set(t.cache)
        latest: dict[str, BuildRecord] = {}
        for b in self._builds.values():
            if b.status in ACTIVE:
                keep |= set(b.cache)
            if b.template_id not in latest or b.created_at > latest[b.template_id].created_at:
                latest[b.template_id] = b
        for b in latest.values():
            keep |= set(b.cache)
        if self._tasks:
            # a running build may be about to reuse an entry, or publish a template checkpoint,
            # it has not recorded yet: prune once no build runs
            return
        dropped = 0
        for cp in self.orch.repo.list(STEP_KIND):
            if cp.id not in keep:
                self.orch.repo.delete(cp.id)
                dropped += 1
        known = {t.checkpoint for t in self._templates.values()}
        for cp in self.orch.repo.list(TEMPLATE_KIND):
            if cp.id not in known:  # a build cut short after its snapshot, before its record
                self.orch.repo.delete(cp.id)
                dropped += 1
        if dropped:
            log.info("build cache: %d unreferenced checkpoints dropped", dropped)
            await self.orch.gc()
