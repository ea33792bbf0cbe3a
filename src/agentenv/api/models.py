"""Wire models. Field names follow E2B's JSON (camelCase) so its SDKs parse them."""

from __future__ import annotations

from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, Field

from agentenv.orchestrator import SandboxRecord

ENVD_VERSION = "0.6.13"


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class NewSandbox(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    templateID: str = Field(min_length=1, max_length=200)
    timeout: int | None = Field(default=None, description="seconds until the sandbox is killed")
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    cpuCount: int | None = None
    memoryMB: int | None = None
    secure: bool | None = None
    autoPause: bool | None = Field(default=None, description="at timeout, pause instead of kill")


class TimeoutRequest(BaseModel):
    timeout: int


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str] = Field(description="a shell string (run with bash -l -c) or an argv list")
    envs: dict[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    timeout: float | None = Field(default=60.0, description="seconds; 0 or null means no limit")
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
    domain: str | None = None
    alias: str | None = None

    @classmethod
    def of(cls, r: SandboxRecord) -> Sandbox:
        return cls(templateID=r.template, sandboxID=r.id, envdAccessToken=r.access_token, alias=r.template)


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
                   state=r.state.value, metadata=r.metadata, error=r.error)


class SandboxDetail(ListedSandbox):
    envdAccessToken: str | None = None

    @classmethod
    def of(cls, r: SandboxRecord) -> SandboxDetail:
        base = ListedSandbox.of(r).model_dump()
        return cls(**base, envdAccessToken=r.access_token)


class TemplateInfo(BaseModel):
    templateID: str
    aliases: list[str]
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    public: bool = True
    buildStatus: str = "ready"
