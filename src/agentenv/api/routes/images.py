"""Templates from OCI images (AgentENV-only): ``POST /images/pull``.

Synchronous: the answer comes once the image is pulled and converted (seconds for a cached
image, longer for a large one), with the new template in E2B's ``TemplateInfo`` shape.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentenv.api.models import TemplateInfo, rfc3339
from agentenv.api.routes import orch_of

router = APIRouter()


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(description="image reference: ubuntu:22.04, docker.io/library/alpine, host:port/repo@sha256:…")
    name: str | None = Field(default=None, description="template name; default: the image's last path component")
    username: str | None = None
    password: str | None = None
    diskSizeMB: int | None = Field(default=None, description="size of the template's disk; default 4096")


@router.post("/images/pull", status_code=201)
async def pull_image(body: PullRequest, request: Request) -> JSONResponse:
    orch = orch_of(request)
    t = await orch.pull(body.image, name=body.name, username=body.username, password=body.password,
                        disk_mb=body.diskSizeMB)
    at = rfc3339(t.created_at)
    info = TemplateInfo(templateID=t.name, buildID=(t.image or {}).get("digest", t.name), aliases=[t.name],
                        names=[t.name], cpuCount=t.vcpus, memoryMB=t.memory_mb, diskSizeMB=t.disk_mb,
                        createdAt=at, updatedAt=at)
    return JSONResponse({**info.model_dump(), "image": t.image}, status_code=201)
