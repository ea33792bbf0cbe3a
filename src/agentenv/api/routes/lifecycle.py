"""Saved-state routes (E2B-shaped): pause, resume, connect, snapshots, fork."""

from __future__ import annotations

import hashlib
import json

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentenv.api import paging
from agentenv.api.errors import status_of
from agentenv.api.models import Sandbox
from agentenv.api.routes import optional_body, orch_of
from agentenv.errors import AgentenvError
from agentenv.orchestrator import SandboxRecord
from agentenv.storage import Checkpoint

router = APIRouter()



class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    memory: bool | None = None
    requireHealthyGuest: bool | None = None


class ResumeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: int | None = Field(default=None, description="seconds from now; default 300")
    autoPause: bool | None = None
    memory: bool | None = Field(default=None, description="false: boot the sandbox's disk instead of "
                                "restoring its memory (always so after a filesystem-only pause)")


class SnapshotRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    memory: bool | None = Field(default=None, description="false: the filesystem only; sandboxes "
                                "started from it boot its disk")


class SnapshotInfo(BaseModel):
    snapshotID: str
    names: list[str]
    sandboxID: str | None = None
    templateID: str | None = None
    createdAt: float | None = None
    cpuCount: int | None = None
    memoryMB: int | None = None

    @classmethod
    def of(cls, cp: Checkpoint) -> SnapshotInfo:
        return cls(snapshotID=cp.id, names=[cp.name] if cp.name else [], sandboxID=cp.source_sandbox,
                   templateID=cp.template, createdAt=cp.created_at, cpuCount=cp.vcpus, memoryMB=cp.memory_mb)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    count: int = 1
    timeout: int | None = None


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204, response_class=Response)
async def pause(sandbox_id: str, request: Request) -> Response:
    """``memory: false``: filesystem-only (the guest flushes its filesystems; resume boots the
    disk). ``requireHealthyGuest``: 503 and nothing changed when the guest agent does not answer."""
    body = await optional_body(request, PauseRequest)
    await orch_of(request).pause(sandbox_id, memory=body.memory is not False,
                                 require_healthy=bool(body.requireHealthyGuest))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201, response_model=Sandbox,
             response_model_exclude_none=True)
async def resume(sandbox_id: str, request: Request) -> Sandbox:
    body = await optional_body(request, ResumeRequest)
    rec = await orch_of(request).resume(sandbox_id, body.timeout, memory=body.memory is not False,
                                        auto_pause=body.autoPause)
    return Sandbox.of(rec, orch_of(request).settings.domain)


@router.post("/sandboxes/{sandbox_id}/connect", response_model=Sandbox, response_model_exclude_none=True)
@router.post("/v2/sandboxes/{sandbox_id}/connect", response_model=Sandbox, response_model_exclude_none=True)
async def connect(sandbox_id: str, request: Request, response: Response) -> Sandbox:
    """200 when it was running (timeout only extended), 201 when it was paused and resumed."""
    body = await optional_body(request, ResumeRequest)
    rec, resumed = await orch_of(request).connect(sandbox_id, body.timeout,
                                                  memory=body.memory is not False)
    response.status_code = 201 if resumed else 200
    return Sandbox.of(rec, orch_of(request).settings.domain)


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotInfo,
             response_model_exclude_none=True)
async def create_snapshot(sandbox_id: str, request: Request) -> SnapshotInfo:
    body = await optional_body(request, SnapshotRequest)
    cp = await orch_of(request).snapshot(sandbox_id, body.name,
                                         memory=body.memory is not False)
    return SnapshotInfo.of(cp)


@router.get("/snapshots", response_model=list[SnapshotInfo], response_model_exclude_none=True)
async def list_snapshots(request: Request, response: Response, sandboxID: str | None = None,
                         name: str | None = None, limit: int = 100,
                         nextToken: str | None = None) -> list[SnapshotInfo]:
    """Newest first, ``limit`` per page (``X-Next-Token``). ``name`` is a snapshot's name or id,
    as the SDK passes it: a ``namespace/`` prefix is dropped and only the ``default`` tag
    matches (snapshots here have no other tags)."""
    paging.check_limit(limit)
    wanted = None
    if name:
        wanted, _, tag = name.rsplit("/", 1)[-1].partition(":")
        if tag not in ("", "default"):
            return []
    cps = [cp for cp in orch_of(request).list_snapshots(sandboxID)
           if wanted is None or wanted in (cp.name, cp.id)]
    page, token = paging.page(cps, lambda cp: (cp.created_at, cp.id), limit, nextToken)
    if token:
        response.headers["X-Next-Token"] = token
    return [SnapshotInfo.of(cp) for cp in page]


@router.delete("/snapshots/{snapshot_id}", status_code=204, response_class=Response)
async def delete_snapshot(snapshot_id: str, request: Request) -> Response:
    await orch_of(request).delete_snapshot(snapshot_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, request: Request) -> JSONResponse:
    """201 with one item per child: ``{"sandbox": …}`` or ``{"error": {code, message}}``. With
    an ``Idempotency-Key`` header a retry gets the children the first request made that are
    still alive (``Idempotent-Replayed: true``), as a create does (orchestrator/idempotency.py)."""
    orch = orch_of(request)
    body = await optional_body(request, ForkRequest)

    async def make(idempotency: dict[str, str] | None = None) -> list[SandboxRecord | Exception]:
        return await orch.fork(sandbox_id, body.count, body.timeout, idempotency)

    headers: dict[str, str] = {}
    key = request.headers.get("idempotency-key")
    if key is None:
        results = await make()
    else:
        asked = json.dumps({"fork": sandbox_id, **body.model_dump(mode="json", exclude_unset=True)}, sort_keys=True)
        replayed, made = await orch.creates.fork(key, hashlib.sha256(asked.encode()).hexdigest(), make)
        if made is not None:
            results = made
        else:
            results = sorted(replayed, key=lambda rec: (rec.started_at, rec.id))
            headers["Idempotent-Replayed"] = "true"
    items: list[dict[str, object]] = []
    for r in results:
        if isinstance(r, Exception):
            status = status_of(r)
            message = r.message if isinstance(r, AgentenvError) else repr(r)
            items.append({"error": {"code": status, "message": message}})
        else:
            items.append({"sandbox": Sandbox.of(r, orch.settings.domain).model_dump(exclude_none=True)})
    return JSONResponse(items, status_code=201, headers=headers)
