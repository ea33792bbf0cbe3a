"""The HTTP API: FastAPI routes over the orchestrator, one call each. See docs/api.md."""

from agentenv.api.app import create_app

__all__ = ["create_app"]
