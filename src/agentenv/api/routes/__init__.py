"""HTTP routes, one module per part of the API."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from agentenv.api.errors import invalid_request_message
from agentenv.errors import InvalidRequest

if TYPE_CHECKING:
    from agentenv.orchestrator import Orchestrator


def orch_of(request: Request) -> Orchestrator:
    """The orchestrator every handler calls into (set on the app by ``create_app``)."""
    return request.app.state.orch  # type: ignore[no-any-return]


Body = TypeVar("Body", bound=BaseModel)


async def optional_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``, or the model's defaults when the body is empty:
    older SDKs send no body to routes whose fields are all optional. 400 names each bad field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw) if raw.strip() else model()
    except ValidationError as exc:
        raise InvalidRequest(invalid_request_message(exc.errors())) from None
