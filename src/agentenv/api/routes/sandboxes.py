"""Sandbox lifecycle routes (E2B-shaped): create, list, get, kill, timeout; templates."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from agentenv.api.models import ListedSandbox, NewSandbox, Sandbox, SandboxDetail, TemplateInfo, TimeoutRequest
from agentenv.errors import InvalidRequest
from agentenv.orchestrator import Orchestrator, State

router = APIRouter()


def _orch(request: Request) -> Orchestrator:
    return request.app.state.orch  # type: ignore[no-any-return]


@router.post("/sandboxes", status_code=201, response_model=Sandbox, response_model_exclude_none=True)
async def create_sandbox(body: NewSandbox, request: Request) -> Sandbox:
    rec = await _orch(request).create(
        body.templateID, vcpus=body.cpuCount, memory_mb=body.memoryMB, timeout_s=body.timeout,
        metadata=body.metadata, env_vars=body.envVars, auto_pause=bool(body.autoPause),
    )
    return Sandbox.of(rec)


def _parse_states(state: str | None) -> set[State] | None:
    if not state:
        return None
    try:
        return {State(s.strip()) for s in state.split(",") if s.strip()}
    except ValueError as exc:
        raise InvalidRequest(f"state must be a comma-separated list of {', '.join(s.value for s in State)}") from exc


def _parse_metadata(values: list[str]) -> dict[str, str]:
    """``metadata=k=v`` (repeatable) or E2B's ``metadata=k%3Dv%26k2%3Dv2`` form."""
    from urllib.parse import unquote

    out: dict[str, str] = {}
    for raw in values:
        for part in unquote(raw).split("&"):
            if not part:
                continue
            kv = part.split("=")
            if len(kv) != 2:
                raise InvalidRequest(f"metadata filter '{part}' must be key=value")
            out[unquote(kv[0])] = unquote(kv[1])
    return out


@router.get("/sandboxes", response_model=list[ListedSandbox])
async def list_sandboxes(request: Request, state: str | None = None,
                         metadata: list[str] = Query(default=[])) -> list[ListedSandbox]:
    recs = _orch(request).list(_parse_states(state), _parse_metadata(metadata))
    return [ListedSandbox.of(r) for r in recs]


@router.get("/sandboxes/{sandbox_id}", response_model=SandboxDetail)
async def get_sandbox(sandbox_id: str, request: Request) -> SandboxDetail:
    return SandboxDetail.of(_orch(request).get(sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", status_code=204, response_class=Response)
async def kill_sandbox(sandbox_id: str, request: Request) -> Response:
    await _orch(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204, response_class=Response)
async def set_timeout(sandbox_id: str, body: TimeoutRequest, request: Request) -> Response:
    await _orch(request).set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.get("/templates", response_model=list[TemplateInfo])
async def list_templates(request: Request) -> list[TemplateInfo]:
    return [TemplateInfo(templateID=t.name, aliases=[t.name], cpuCount=t.vcpus, memoryMB=t.memory_mb,
                         diskSizeMB=t.disk_mb) for t in _orch(request).templates()]
