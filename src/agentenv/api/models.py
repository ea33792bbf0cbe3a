"""Wire models. Field names follow E2B's JSON (camelCase) so its SDKs parse them.

Request models ignore unknown fields (newer SDKs add fields); what a field cannot mean here is
refused with 400 by the route, never silently dropped when it would change behaviour.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from agentenv.orchestrator import SandboxRecord
from agentenv.orchestrator.lifecycle import api_state

ENVD_VERSION = "0.6.13"


def _utf8(value: str) -> str:
    """JSON can carry lone surrogates (``"\ud800"``) that no UTF-8 text holds: stored, they
    made every listing that included them fail, and a command's environment cannot take them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it holds a lone surrogate escape)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


class AutoResume(BaseModel):
    model_config = ConfigDict(extra="ignore")
    enabled: bool = False


class NetworkConfig(BaseModel):
    """SandboxNetworkConfig (create) and SandboxNetworkUpdateConfig (PUT .../network)."""

    model_config = ConfigDict(extra="ignore")
    allowPublicTraffic: bool | None = None
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    maskRequestHost: str | None = None
    egressProxy: dict[str, Any] | None = None
    dnsServers: list[Any] | None = None
    rules: dict[str, Any] | None = None
    httpsPorts: list[int] | None = None
    allow_internet_access: bool | None = None  # update body only (snake_case on the wire)


class NewSandbox(BaseModel):
    """NewSandbox (v1, ``POST /sandboxes``) and NewSandboxV2 (``POST /v2/sandboxes``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    templateID: Text = Field(min_length=1, max_length=200)
    timeout: int | None = Field(default=None, description="seconds until the sandbox is killed (default 300)")
    metadata: dict[Text, Text] | None = None
    envVars: dict[Text, Text] | None = None
    cpuCount: int | None = None
    memoryMB: int | None = None
    secure: bool | None = None
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: AutoResume | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volumeMounts: list[dict[str, Any]] | None = None


class TimeoutRequest(BaseModel):
    timeout: int


class RefreshRequest(BaseModel):
    duration: int | None = None


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: Text | Annotated[list[Text], Field(min_length=1)] = Field(
        description="a shell string (run with bash -l -c) or an argv list")
    envs: dict[Text, Text] | None = None
    cwd: Text | None = None
    user: Text | None = None
    timeout: float | None = Field(default=60.0, ge=0, le=86400, allow_inf_nan=False,
                                  description="seconds (at most a day); 0 or null means no limit")
    stream: bool = Field(default=False, description="answer with NDJSON events as they happen")


class ExecResult(BaseModel):
    exitCode: int
    stdout: str
    stderr: str
    error: str | None = None


class Sandbox(BaseModel):
    templateID: str
    sandboxID: str
    clientID: str = ""
    envdVersion: str = ENVD_VERSION
    envdAccessToken: str | None = None
    trafficAccessToken: str | None = None
    domain: str | None = None
    alias: str | None = None

    @classmethod
    def of(cls, r: SandboxRecord, domain: str | None = None) -> Sandbox:
        return cls(templateID=r.template, sandboxID=r.id, envdAccessToken=r.access_token, alias=r.template,
                   trafficAccessToken=r.options.get("trafficAccessToken"), domain=domain)


class ListedSandbox(BaseModel):
    templateID: str
    sandboxID: str
    clientID: str = ""
    alias: str | None = None
    startedAt: str
    endAt: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: str
    envdVersion: str = ENVD_VERSION
    metadata: dict[str, str] = {}
    error: str | None = None

    @classmethod
    def of(cls, r: SandboxRecord) -> ListedSandbox:
        return cls(templateID=r.template, sandboxID=r.id, alias=r.template, startedAt=rfc3339(r.started_at),
                   endAt=rfc3339(r.end_at), cpuCount=r.vcpus, memoryMB=r.memory_mb, diskSizeMB=r.disk_mb,
                   state=api_state(r.state), metadata=r.metadata, error=r.error)


class SandboxDetail(ListedSandbox):
    envdAccessToken: str | None = None
    domain: str | None = None
    allowInternetAccess: bool | None = None
    network: dict[str, Any] | None = None
    lifecycle: dict[str, Any] | None = None
    pauseMode: str | None = None  # a paused sandbox: "full" (memory too) or "filesystem"
    envdUnresponsiveAtPause: bool | None = None  # paused with a hung guest agent: resumes only with memory: false

    @classmethod
    def of(cls, r: SandboxRecord, domain: str | None = None) -> SandboxDetail:  # type: ignore[override]
        base = ListedSandbox.of(r).model_dump()
        net = r.options.get("network") or {}
        wire_net: dict[str, Any] = {k: v for k, v in net.items() if v not in (None, [])}
        auto_resume = bool((r.options.get("autoResume") or {}).get("enabled", False))
        internet = r.options.get("allowInternetAccess")
        if internet is None:
            internet = "0.0.0.0/0" not in net.get("denyOut", []) or bool(net.get("allowOut"))
        mode = None
        if r.paused is not None:
            mode = "filesystem" if r.paused.filesystem_only else "full"
        return cls(**base, envdAccessToken=r.access_token, domain=domain, allowInternetAccess=internet,
                   network=wire_net or None, pauseMode=mode,
                   envdUnresponsiveAtPause=True if r.paused is not None and r.paused.guest_unresponsive else None,
                   lifecycle={"autoResume": auto_resume,
                              "onTimeout": "pause" if r.options.get("autoPause") else "kill"})


class SandboxMetric(BaseModel):
    timestamp: str
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int

    @classmethod
    def of(cls, m: dict[str, Any]) -> SandboxMetric:
        return cls(timestamp=rfc3339(m["timestampUnix"]), **m)


class TemplateInfo(BaseModel):
    """E2B's Template (``GET /templates``)."""

    templateID: str
    buildID: str
    aliases: list[str]
    names: list[str]
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    public: bool = True
    createdAt: str
    updatedAt: str
    createdBy: None = None
    lastSpawnedAt: str | None = None
    spawnCount: int = 0
    buildCount: int = 1
    envdVersion: str = ENVD_VERSION
    buildStatus: str = "ready"
    isDefault: bool = False  # one of the platform's own templates (base, code-interpreter), not a build


class TemplateBuild(BaseModel):
    """One build of a template, as E2B lists it (its buildID a UUID, which the SDK parses)."""

    buildID: str
    status: str
    createdAt: str
    updatedAt: str
    finishedAt: str | None = None
    cpuCount: int
    memoryMB: int
    diskSizeMB: int | None = None
    envdVersion: str = ENVD_VERSION

    @model_serializer(mode="wrap")
    def _without_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The SDK parses finishedAt and diskSizeMB when present: absent, not null, until known.
        return {k: v for k, v in handler(self).items() if v is not None}


class TemplateWithBuilds(TemplateInfo):
    """E2B's TemplateWithBuilds (``GET /templates/{id}``): the template and its builds, newest first."""

    builds: list[TemplateBuild]
