"""Errors become HTTP answers here, and only here.

Body shape is E2B's: ``{"code": <http status>, "message": "..."}``. The status of each error
class is found by walking the exception's MRO through ``STATUS``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from agentenv import errors as e
from agentenv.envd_client import EnvdError

log = logging.getLogger(__name__)


def invalid_request_message(errors: Sequence[Any]) -> str:
    """One line naming each field that failed validation and why (pydantic's own words)."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


STATUS: dict[type[BaseException], int] = {
    e.InvalidRequest: 400,
    e.NotFound: 404,
    e.SandboxStateError: 409,
    e.IdempotencyKeyReused: 422,
    e.CapacityExhausted: 429,
    e.GuestUnresponsive: 503,
    e.DiskFull: 507,
    e.SnapshotUnusable: 422,
    e.RegistryAuthFailed: 401,
    e.ImageCorrupt: 422,
    e.RegistryUnreachable: 504,
    e.GuestError: 502,
    e.PlatformError: 500,
    e.AgentenvError: 500,
}

# Connect codes of the guest agent, as HTTP statuses of the native exec/files routes.
ENVD_STATUS = {
    "invalid_argument": 400, "unauthenticated": 400, "not_found": 404, "already_exists": 409,
    "permission_denied": 403, "resource_exhausted": 507, "deadline_exceeded": 504,
    "unavailable": 502, "unimplemented": 501,
}


def status_of(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_response(status: int, message: str, headers: dict[str, str] | None = None,
                   error_code: str | None = None) -> JSONResponse:
    """E2B's error body; ``error_code`` where E2B's API sends one that the SDKs map to an
    exception of its own."""
    body: dict[str, object] = {"code": status, "message": message}
    if error_code:
        body["error_code"] = error_code
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(e.AgentenvError)
    async def _agentenv(_req: Request, exc: e.AgentenvError) -> JSONResponse:
        status = status_of(exc)
        if status >= 500:
            log.error("%s: %s", type(exc).__name__, exc.message)
        headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, e.CapacityExhausted) else None
        if isinstance(exc, e.PlatformError):
            # The E2B SDKs (2.x) resend a request that got 502/503/504 unless told not to: a
            # create whose guest did not answer would start up to three more VMs, each waiting
            # out the restore timeout. E2B answers its internal errors with 500, not retried.
            headers = {"Should-Retry": "false"}
        return error_response(status, exc.message, headers, getattr(exc, "error_code", None))

    @app.exception_handler(EnvdError)
    async def _envd(_req: Request, exc: EnvdError) -> JSONResponse:
        return error_response(ENVD_STATUS.get(exc.code, 502), f"guest agent: {exc.message}")

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, invalid_request_message(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        # A bug, not a client's error: still the JSON body every client parses (the
        # traceback is logged by the server's error middleware, which re-raises it).
        return error_response(500, f"internal error: {type(exc).__name__}")
