"""Template routes, as E2B's control plane: list/get/alias/delete, and builds from steps
(build system v2: ``POST /v3/templates``, file uploads for COPY, ``POST
/v2/templates/{id}/builds/{buildID}``, build status). See docs/api.md and
docs/mechanisms/template-builds.md."""

from __future__ import annotations

import hashlib
import hmac
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentenv.api.models import (
    TemplateBuild,
    TemplateInfo,
    TemplateWithBuilds,
    rfc3339,
)
from agentenv.api.routes import optional_body, orch_of
from agentenv.errors import InvalidRequest, NotFound, RequestError
from agentenv.orchestrator import Orchestrator
from agentenv.orchestrator.builds import BuildRecord, LogEntry, TemplateEntry, tags

router = APIRouter()
# The upload of COPY files: the SDK PUTs to the url it was given, without the API key (as to
# a pre-signed S3 url), so that url carries its own token.
uploads = APIRouter()



# -- wire models ----------------------------------------------------------------------------

class TemplateBuildRequest(BaseModel):
    """TemplateBuildRequestV3 (``name``) and the legacy V2 (``alias``)."""

    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    alias: str | None = None
    tags: list[str] | None = None
    cpuCount: int | None = None
    memoryMB: int | None = None
    minFreeDiskMb: int | None = None
    teamID: str | None = None


class TemplateRequestResponse(BaseModel):
    templateID: str
    buildID: str
    public: bool = True
    names: list[str]
    tags: list[str]
    aliases: list[str]


class FileUpload(BaseModel):
    present: bool
    url: str | None = None


class BuildLogEntry(BaseModel):
    timestamp: str
    message: str
    level: str
    step: str | None = None

    @classmethod
    def of(cls, e: LogEntry) -> BuildLogEntry:
        return cls(timestamp=rfc3339(e.timestamp), message=e.message, level=e.level, step=e.step)


class BuildStatusReason(BaseModel):
    message: str
    step: str | None = None
    logEntries: list[BuildLogEntry] | None = None


class TemplateBuildInfo(BaseModel):
    templateID: str
    buildID: str
    status: str = Field(description="waiting | building | ready | error")
    logs: list[str]
    logEntries: list[BuildLogEntry]
    reason: BuildStatusReason | None = None


class TemplateTag(BaseModel):
    tag: str
    buildID: str
    createdAt: str


class AssignTagsRequest(BaseModel):
    target: str = Field(description="name:tag of the build to tag (name alone: its default tag)")
    tags: list[str]


class AssignedTags(BaseModel):
    tags: list[str]
    buildID: str


class DeleteTagsRequest(BaseModel):
    name: str
    tags: list[str]


# -- template info --------------------------------------------------------------------------

def _catalog_info(orch: Orchestrator, name: str) -> TemplateInfo:
    t = orch.catalog.get(name)
    created = orch.template_created_at(t.name)
    at = rfc3339(created)
    # A UUID, as E2B's build ids are (the SDK parses them): one per build of the template.
    build_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"agentenv:template:{t.name}:{created}"))
    return TemplateInfo(templateID=t.name, buildID=build_id, aliases=[t.name], names=[t.name], cpuCount=t.vcpus,
                        memoryMB=t.memory_mb, diskSizeMB=t.disk_mb, createdAt=at, updatedAt=at,
                        isDefault=t.image is None)


def _built_info(t: TemplateEntry) -> TemplateInfo:
    return TemplateInfo(templateID=t.template_id, buildID=t.build_id, aliases=[t.template_id],
                        names=[t.template_id], cpuCount=t.vcpus, memoryMB=t.memory_mb, diskSizeMB=t.disk_mb,
                        createdAt=rfc3339(t.created_at), updatedAt=rfc3339(t.updated_at),
                        buildCount=t.build_count, buildStatus="ready")


def _pending_info(orch: Orchestrator, b: BuildRecord) -> TemplateInfo:
    at = rfc3339(b.created_at)
    return TemplateInfo(templateID=b.template_id, buildID=b.build_id, aliases=[b.template_id],
                        names=[b.template_id], cpuCount=b.vcpus or 1, memoryMB=b.memory_mb or 512,
                        diskSizeMB=0, createdAt=at, updatedAt=at, buildCount=0, buildStatus=b.status)


def _info(orch: Orchestrator, template_id: str) -> TemplateInfo:
    if orch.catalog.exists(template_id):
        return _catalog_info(orch, template_id)
    if orch.builds.exists(template_id):
        return _built_info(orch.builds.template(template_id))
    for b in orch.builds.pending():
        if b.template_id == template_id:
            return _pending_info(orch, b)
    return _catalog_info(orch, template_id)  # TemplateNotFound → 404


@router.get("/templates", response_model=list[TemplateInfo])
async def list_templates(request: Request) -> list[TemplateInfo]:
    """Built-in templates, built templates, and first builds still running or failed."""
    orch = orch_of(request)
    out = [_catalog_info(orch, t.name) for t in orch.templates()]
    out += [_built_info(t) for t in orch.builds.templates()]
    out += [_pending_info(orch, b) for b in orch.builds.pending()]
    return out


# (before the /templates/{template_id} routes, which would take "tags" for a template id)
@router.post("/templates/tags", status_code=201, response_model=AssignedTags)
async def assign_tags(body: AssignTagsRequest, request: Request) -> AssignedTags:
    """``Template.assign_tags(target, tags)``: the build ``target`` names gets ``tags`` too."""
    t = tags.assign(orch_of(request).builds, body.target, body.tags)
    return AssignedTags(tags=sorted(body.tags), buildID=t.build_id)


@router.delete("/templates/tags", status_code=204, response_class=Response)
async def remove_tags(body: DeleteTagsRequest, request: Request) -> Response:
    """``Template.remove_tags(name, tags)``."""
    tags.remove(orch_of(request).builds, body.name, body.tags)
    return Response(status_code=204)


@router.get("/templates/aliases/{alias}")
async def template_alias(alias: str, request: Request) -> JSONResponse:
    """``Template.exists(name)``: 200 if a template has this name or alias (also while its first
    build is pending or runs: the name is taken), else 404."""
    orch = orch_of(request)
    pending = any(b.status in ("waiting", "building") for b in orch.builds.builds_of(alias))
    if orch.builds.exists(alias) or pending:  # built, or its first build under way (a failed one frees it)
        return JSONResponse({"templateID": alias, "public": True})
    t = orch.catalog.get(alias)  # TemplateNotFound → 404
    return JSONResponse({"templateID": t.name, "public": True})


@router.get("/templates/{template_id}", response_model=TemplateWithBuilds)
async def get_template(template_id: str, request: Request) -> TemplateWithBuilds:
    orch = orch_of(request)
    info = _info(orch, template_id)
    records = sorted(orch.builds.builds_of(info.templateID), key=lambda b: b.created_at, reverse=True)
    if records:
        builds = [_build_info(b, info) for b in records]
    else:  # a built-in template: the one build it is
        builds = [TemplateBuild(buildID=info.buildID, status="ready", createdAt=info.createdAt,
                                updatedAt=info.updatedAt, finishedAt=info.updatedAt, cpuCount=info.cpuCount,
                                memoryMB=info.memoryMB, diskSizeMB=info.diskSizeMB)]
    return TemplateWithBuilds(**info.model_dump(), builds=builds)


def _build_info(b: BuildRecord, info: TemplateInfo) -> TemplateBuild:
    finished = rfc3339(b.finished_at) if b.finished_at else None
    return TemplateBuild(buildID=b.build_id, status=b.status, createdAt=rfc3339(b.created_at),
                         updatedAt=finished or rfc3339(b.created_at), finishedAt=finished,
                         cpuCount=b.vcpus or info.cpuCount, memoryMB=b.memory_mb or info.memoryMB)


@router.delete("/templates/{template_id}", status_code=204, response_class=Response)
async def delete_template(template_id: str, request: Request) -> Response:
    """A built template (sandboxes started from it keep running), or a snapshot by id or
    name (E2B deletes snapshot templates here too). Built-in templates cannot be deleted."""
    orch = orch_of(request)
    if orch.catalog.exists(template_id):
        await orch.delete_image_template(template_id)  # 400 for built-in ones (base)
        return Response(status_code=204)
    if orch.builds.exists(template_id) or orch.builds.builds_of(template_id):
        await orch.builds.delete_template(template_id)
    else:
        await orch.delete_snapshot(template_id)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags", response_model=list[TemplateTag])
async def template_tags(template_id: str, request: Request) -> list[TemplateTag]:
    t = orch_of(request).builds.template(template_id)
    return [TemplateTag(tag=tag, buildID=t.build_id, createdAt=rfc3339(t.updated_at)) for tag in t.tags]


# -- builds ---------------------------------------------------------------------------------

@router.post("/v3/templates", status_code=202, response_model=TemplateRequestResponse)
@router.post("/v2/templates", status_code=202, response_model=TemplateRequestResponse)
@router.post("/templates", status_code=202, response_model=TemplateRequestResponse)
async def request_build(request: Request) -> TemplateRequestResponse:
    """A new build of template ``name`` (``name:tag`` adds a tag); started by the POST below."""
    body: TemplateBuildRequest = await optional_body(request, TemplateBuildRequest)
    name = body.name or body.alias
    if not name:
        raise InvalidRequest("name is required")
    b = orch_of(request).builds.request(name, tags=body.tags, vcpus=body.cpuCount, memory_mb=body.memoryMB)
    return TemplateRequestResponse(templateID=b.template_id, buildID=b.build_id, names=[b.template_id],
                                   tags=b.tags, aliases=[b.template_id])


def upload_token(request: Request, files_hash: str) -> str:
    key: str = request.app.state.api_key
    return hmac.new(key.encode(), f"build-files/{files_hash}".encode(), hashlib.sha256).hexdigest()[:32]


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201, response_model=FileUpload,
            response_model_exclude_none=True)
async def file_upload_link(template_id: str, files_hash: str, request: Request) -> FileUpload:
    """Whether the COPY files with this hash are stored; if not, where to PUT their tar(.gz)."""
    builds = orch_of(request).builds
    if builds.has_upload(files_hash):
        return FileUpload(present=True)
    url = f"{str(request.base_url).rstrip('/')}/templates/{template_id}/files/{files_hash}" \
          f"?token={upload_token(request, files_hash)}"
    return FileUpload(present=False, url=url)


@uploads.put("/templates/{template_id}/files/{files_hash}", status_code=204, response_class=Response)
async def upload_files(template_id: str, files_hash: str, request: Request, token: str = "") -> Response:
    """The tar(.gz) of a COPY step's files, stored as ``<data>/build-files/<hash>``."""
    if not hmac.compare_digest(token.encode(), upload_token(request, files_hash).encode()):
        return JSONResponse({"code": 403, "message": "missing or wrong upload token: use the url that "
                                                     "GET /templates/{id}/files/{hash} returns"}, status_code=403)
    orch = orch_of(request)
    if orch.builds.has_upload(files_hash):
        # Stored files are shared by every build with this hash and kept as first uploaded:
        # a later PUT (the url never expires) must not swap what those builds copy. It is
        # still a success, as a repeated PUT to a pre-signed S3 URL is: two builds sharing a
        # COPY step both see the files absent, and the SDKs fail the build on an error here.
        async for _ in request.stream():
            pass
        return Response(status_code=204)
    limit = orch.settings.build_upload_max_mb << 20
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise InvalidRequest(f"the upload ({int(length) >> 20} MiB) is larger than the limit of "
                             f"{limit >> 20} MiB (AENV_BUILD_UPLOAD_MAX_MB)")
    await orch.builds.store_upload(files_hash, request.stream(), limit)
    return Response(status_code=204)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202, response_class=Response)
async def start_build(template_id: str, build_id: str, request: Request) -> Response:
    """TemplateBuildStartV2: base, steps, startCmd, readyCmd; the build runs in the background."""
    import json

    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    orch_of(request).builds.start_build(template_id, build_id, body)
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status", response_model=TemplateBuildInfo,
            response_model_exclude_none=True)
async def build_status(template_id: str, build_id: str, request: Request, logsOffset: int = 0,
                       limit: int = 100, level: str | None = None) -> TemplateBuildInfo:
    b = orch_of(request).builds.build(template_id, build_id)
    entries = [BuildLogEntry.of(e) for e in orch_of(request).builds.entries(b, logsOffset, min(limit, 1000), level)]
    reason = None
    if b.reason:
        tail = [BuildLogEntry.of(e) for e in b.logs[-20:] if e.level == "error" or e.step == b.reason.get("step")]
        reason = BuildStatusReason(message=b.reason["message"], step=b.reason.get("step"), logEntries=tail)
    return TemplateBuildInfo(templateID=b.template_id, buildID=b.build_id, status=b.status,
                             logs=[e.message for e in entries], logEntries=entries, reason=reason)


__all__ = ["NotFound", "RequestError", "router", "uploads"]
