"""HTTP routes, one module per part of the API."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

if TYPE_CHECKING:
    from agentenv.orchestrator import Orchestrator


def orch_of(request: Request) -> Orchestrator:
    """The orchestrator every handler calls into (set on the app by ``create_app``)."""
    return request.app.state.orch  # type: ignore[no-any-return]
