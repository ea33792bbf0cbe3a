"""E2B routes AgentENV does not have (volumes, secrets): a 501 that says so. The plain 404 of
an unknown route read, to the SDKs, as "no such volume" (``Volume.destroy`` returned False,
``Secret.get`` said the secret did not exist)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from agentenv.api.errors import error_response

router = APIRouter()

METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def _not_supported(feature: str) -> JSONResponse:
    return error_response(501, f"{feature} are not supported by AgentENV: keep data in the sandbox's disk, "
                               f"snapshots and env vars instead")


@router.api_route("/volumes", methods=METHODS, include_in_schema=False)
@router.api_route("/volumes/{rest:path}", methods=METHODS, include_in_schema=False)
async def volumes() -> JSONResponse:
    return _not_supported("volumes")


@router.api_route("/secrets", methods=METHODS, include_in_schema=False)
@router.api_route("/secrets/{rest:path}", methods=METHODS, include_in_schema=False)
async def secrets() -> JSONResponse:
    return _not_supported("secrets")
