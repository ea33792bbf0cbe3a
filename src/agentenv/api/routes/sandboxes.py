"""Sandbox lifecycle routes, as E2B's control plane: create (v1 and v2), list (v1 and v2),
get, kill, timeout, refresh, network, metrics. Templates: routes/templates.py. See docs/api.md."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import unquote

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv.api import paging
from agentenv.api.models import (
    ListedSandbox,
    NetworkConfig,
    NewSandbox,
    RefreshRequest,
    Sandbox,
    SandboxDetail,
    SandboxMetric,
    TimeoutRequest,
)
from agentenv.api.routes import orch_of
from agentenv.envd_client import EnvdError
from agentenv.errors import InvalidRequest, PlatformError, RequestError
from agentenv.orchestrator import Orchestrator, SandboxRecord, State
from agentenv.orchestrator.idempotency import OPTION as IDEMPOTENCY
from agentenv.orchestrator.ids import new_access_token
from agentenv.orchestrator.lifecycle import api_state

router = APIRouter()

ALL_TRAFFIC = "0.0.0.0/0"



def _domain(request: Request) -> str | None:
    return orch_of(request).settings.domain


# -- create ---------------------------------------------------------------------------------

def _unsupported_network(net: NetworkConfig, prefix: str = "network") -> None:
    for name in ("egressProxy", "dnsServers", "rules"):
        if getattr(net, name):
            raise InvalidRequest(f"{prefix}.{name} is not supported by AgentENV (egress is filtered by "
                                 "address with allowOut/denyOut); leave it out")
    if net.httpsPorts:  # (accepted and ignored, a TLS server there would get plain HTTP)
        raise InvalidRequest(f"{prefix}.httpsPorts is not supported by AgentENV: its proxy speaks plain HTTP "
                             "to every port of a sandbox; leave it out and serve HTTP there")


def _create_options(body: NewSandbox) -> dict[str, Any]:
    """The E2B create fields that outlive the create call, checked."""
    if body.autoPauseMemory is not None and not body.autoPause:
        raise InvalidRequest("autoPauseMemory requires autoPause: true")
    if body.autoPauseMemory is False and body.autoResume and body.autoResume.enabled:
        raise InvalidRequest("autoPauseMemory: false (filesystem-only pause) cannot be combined with "
                             "autoResume.enabled: true")
    if body.volumeMounts:
        raise InvalidRequest("volumeMounts: volumes are not supported by AgentENV")
    if body.iam and body.iam.get("tokens"):
        raise InvalidRequest("iam: workload identity tokens are not supported by AgentENV")
    opts: dict[str, Any] = {}
    net = body.network or NetworkConfig()
    _unsupported_network(net)
    allow, deny = list(net.allowOut or []), list(net.denyOut or [])
    if body.allow_internet_access is False and ALL_TRAFFIC not in deny:
        deny.append(ALL_TRAFFIC)
    network: dict[str, Any] = {"allowOut": allow, "denyOut": deny}
    if net.allowPublicTraffic is not None:
        network["allowPublicTraffic"] = net.allowPublicTraffic
    if net.maskRequestHost:
        network["maskRequestHost"] = net.maskRequestHost
    opts["network"] = network
    if net.allowPublicTraffic is False:
        opts["trafficAccessToken"] = new_access_token()
    if body.allow_internet_access is not None:
        opts["allowInternetAccess"] = body.allow_internet_access
    for name in ("autoPause", "autoPauseMemory", "secure", "mcp"):
        if getattr(body, name) is not None:
            opts[name] = getattr(body, name)
    if body.autoResume is not None:
        opts["autoResume"] = {"enabled": body.autoResume.enabled}
    return opts


async def _create(body: NewSandbox, request: Request, response: Response) -> Sandbox:
    """With an ``Idempotency-Key`` header, a retry gets the sandbox the first request made
    (``Idempotent-Replayed: true``) instead of a second one (orchestrator/idempotency.py)."""
    orch = orch_of(request)
    options = _create_options(body)

    async def make(idempotency: dict[str, str] | None = None) -> SandboxRecord:
        return await orch.create(
            body.templateID, vcpus=body.cpuCount, memory_mb=body.memoryMB, timeout_s=body.timeout,
            metadata=body.metadata, env_vars=body.envVars,
            options={**options, **({IDEMPOTENCY: idempotency} if idempotency else {})})

    key = request.headers.get("idempotency-key")
    if key is None:
        rec = await make()
    else:
        canonical = json.dumps(body.model_dump(mode="json", exclude_unset=True), sort_keys=True)
        rec, replayed = await orch.creates.create(key, hashlib.sha256(canonical.encode()).hexdigest(), make)
        if replayed:
            response.headers["Idempotent-Replayed"] = "true"
            if rec.state != State.RUNNING:  # paused since: a create answers with a running sandbox
                rec, _ = await orch.connect(rec.id, body.timeout)
    return Sandbox.of(rec, _domain(request))


@router.post("/sandboxes", status_code=201, response_model=Sandbox, response_model_exclude_none=True)
async def create_sandbox(body: NewSandbox, request: Request, response: Response) -> Sandbox:
    """v1 create (SDK ≤ 2.45). The envd access token is always returned: every sandbox's
    agent checks it, whether or not the caller asked for ``secure``."""
    return await _create(body, request, response)


@router.post("/v2/sandboxes", status_code=201, response_model=Sandbox, response_model_exclude_none=True)
async def create_sandbox_v2(body: NewSandbox, request: Request, response: Response) -> Sandbox:
    return await _create(body, request, response)


# -- list -----------------------------------------------------------------------------------

E2B_STATES = frozenset({"running", "paused"})  # all the states the E2B SDKs' models accept


def _parse_states(state: str | None, default: set[str] | None) -> set[str] | None:
    if not state:
        return default
    known = {s.value for s in State} | {"paused"}
    wanted = {s.strip() for s in state.split(",") if s.strip()}
    if not wanted <= known:
        raise InvalidRequest(f"state must be a comma-separated list of {', '.join(sorted(known))}")
    return wanted


def _parse_metadata(values: list[str] | None) -> dict[str, str]:
    """E2B's ``metadata=k%3Dv%26k2%3Dv2`` (keys and values quoted once more), or ``k=v``."""
    out: dict[str, str] = {}
    for raw in values or []:
        for part in unquote(raw).split("&"):
            if not part:
                continue
            kv = part.split("=")
            if len(kv) != 2:
                raise InvalidRequest(f"metadata filter '{part}' must be key=value")
            out[unquote(kv[0])] = unquote(kv[1])
    return out


def _select(orch: Orchestrator, states: set[str] | None, metadata: dict[str, str]) -> list[SandboxRecord]:
    return [r for r in orch.list(None, metadata)
            if states is None or r.state.value in states or api_state(r.state) in states]


@router.get("/sandboxes", response_model=list[ListedSandbox])
async def list_sandboxes(request: Request, state: str | None = None,
                         metadata: Annotated[list[str] | None, Query()] = None) -> list[ListedSandbox]:
    """v1 list: no pagination, newest first. Without ``state``, running sandboxes only, as E2B
    answers SDK 1.x (whose ``Sandbox.list()`` means "the sandboxes I can use now"); ``aenv ls``
    asks for every state, ``error`` ones included, so that they can be found and killed."""
    recs = _select(orch_of(request), _parse_states(state, {"running"}), _parse_metadata(metadata))
    return [ListedSandbox.of(r) for r in recs]


@router.get("/v2/sandboxes", response_model=list[ListedSandbox])
async def list_sandboxes_v2(request: Request, response: Response, state: str | None = None,
                            metadata: Annotated[list[str] | None, Query()] = None, order: str = "desc",
                            startedAfter: str | None = None, template: str | None = None,
                            limit: int = 100, nextToken: str | None = None) -> list[ListedSandbox]:
    """Running and paused sandboxes by default, newest first, ``limit`` per page; the cursor
    of the next page is in the ``X-Next-Token`` header (absent on the last page)."""
    paging.check_limit(limit)
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc")
    if template and ":" in template:
        raise InvalidRequest("template filter takes a template ID or alias without a tag")
    orch = orch_of(request)
    recs = _select(orch, _parse_states(state, E2B_STATES), _parse_metadata(metadata))
    if startedAfter:
        try:
            after = datetime.fromisoformat(startedAfter)
        except ValueError as exc:
            raise InvalidRequest(f"startedAfter must be an RFC 3339 time, got '{startedAfter}'") from exc
        if after.tzinfo is None:
            after = after.replace(tzinfo=UTC)
        # Compared as datetimes (microseconds), as the times were given out in startedAt.
        recs = [r for r in recs if datetime.fromtimestamp(r.started_at, UTC) >= after]
    if template:
        recs = [r for r in recs if r.template == template]
    page, token = paging.page(recs, lambda r: (r.started_at, r.id), limit, nextToken, ascending=order == "asc")
    if token:
        response.headers["X-Next-Token"] = token
    response.headers["X-Total-Running"] = str(sum(1 for r in orch.list() if r.state == State.RUNNING))
    return [ListedSandbox.of(r) for r in page]


# -- one sandbox ----------------------------------------------------------------------------

@router.get("/sandboxes/metrics")
async def sandboxes_metrics(request: Request, sandbox_ids: str = Query(min_length=1)) -> dict[str, Any]:
    """The latest metric of each listed running sandbox (unknown ids are left out)."""
    orch = orch_of(request)

    async def latest(sid: str) -> tuple[str, dict[str, Any] | None]:
        try:
            points = await orch.metrics(sid, running_only=True)
        except (RequestError, PlatformError, EnvdError):  # unknown, not running, unreachable: left out
            return sid, None
        return sid, SandboxMetric.of(points[-1]).model_dump() if points else None

    ids = list(dict.fromkeys(s for s in sandbox_ids.split(",") if s))[:100]
    results = await asyncio.gather(*(latest(sid) for sid in ids))
    return {"sandboxes": {sid: m for sid, m in results if m is not None}}


@router.get("/sandboxes/{sandbox_id}", response_model=SandboxDetail, response_model_exclude_none=True,
            responses={410: {"description": "the sandbox failed (state `error`); the message says why"}})
async def get_sandbox(sandbox_id: str, request: Request) -> SandboxDetail | JSONResponse:
    """A sandbox being created or killed is answered once that has ended (running, or 404)."""
    rec = await orch_of(request).get_settled(sandbox_id)
    if rec.state == State.ERROR:
        # E2B SDKs fail to parse a state other than running or paused, so a failed sandbox is
        # 410 Gone: they raise it with the reason as the message. The record stays (with
        # `state` and `error` here for other clients) until DELETE clears it.
        return JSONResponse(status_code=410, content={
            "code": 410, "message": f"sandbox '{rec.id}' failed: {rec.error}; DELETE it to clear its record",
            "sandboxID": rec.id, "state": rec.state.value, "error": rec.error})
    return SandboxDetail.of(rec, _domain(request))


@router.delete("/sandboxes/{sandbox_id}", status_code=204, response_class=Response)
async def kill_sandbox(sandbox_id: str, request: Request) -> Response:
    await orch_of(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204, response_class=Response)
async def set_timeout(sandbox_id: str, body: TimeoutRequest, request: Request) -> Response:
    await orch_of(request).set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204, response_class=Response)
async def refresh(sandbox_id: str, request: Request, body: RefreshRequest | None = None) -> Response:
    """Keep the sandbox alive ``duration`` more seconds (default: the node's default timeout);
    never shortens its timeout."""
    orch = orch_of(request)
    duration = body.duration if body and body.duration is not None else orch.settings.default_timeout_s
    await orch.refresh(sandbox_id, duration)
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204, response_class=Response)
async def update_network(sandbox_id: str, body: NetworkConfig, request: Request) -> Response:
    """Full replacement of the egress rules: omitted lists are cleared."""
    _unsupported_network(body)
    deny = list(body.denyOut or [])
    if body.allow_internet_access is False and ALL_TRAFFIC not in deny:
        deny.append(ALL_TRAFFIC)
    await orch_of(request).update_network(sandbox_id, list(body.allowOut or []), deny)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics", response_model=list[SandboxMetric])
async def sandbox_metrics(sandbox_id: str, request: Request, start: int | None = None,
                          end: int | None = None) -> list[SandboxMetric]:
    points = await orch_of(request).metrics(sandbox_id, start, end)
    return [SandboxMetric.of(m) for m in points]
