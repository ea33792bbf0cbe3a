"""The ASGI application: routes, auth and the lifespan that starts and stops the orchestrator."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware

from agentenv import __version__
from agentenv.api import errors
from agentenv.api.routes import (
    data,
    images,
    lifecycle,
    sandboxes,
    system,
    templates,
    unsupported,
)
from agentenv.orchestrator import Orchestrator


def create_app(orch: Orchestrator, api_key: str,
               on_stop: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The API. Its lifespan starts and stops the orchestrator; ``on_stop`` runs first on the
    way down (the sandbox proxy in front of it, put there by server.py, closes its clients)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await orch.start()
        try:
            yield
        finally:
            if on_stop is not None:
                await on_stop()
            await orch.stop()

    async def require_key(request: Request) -> None:
        given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise _Unauthorized("missing or invalid API key: send it in the X-API-Key header")

    app = FastAPI(title="AgentENV API", version=__version__, lifespan=lifespan)
    # The JS SDK runs in browsers too: E2B's API answers CORS from any origin. Nothing rides
    # on ambient credentials here (the key is a header a page must set itself).
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                       expose_headers=["X-Next-Token", "Idempotent-Replayed", "Retry-After"], max_age=3600)
    app.state.orch = orch
    app.state.api_key = api_key  # signs the upload urls of template builds (routes/templates.py)
    errors.install(app)

    @app.exception_handler(_Unauthorized)
    async def _unauth(_req: Request, exc: _Unauthorized):  # type: ignore[no-untyped-def]
        return errors.error_response(401, str(exc))

    app.include_router(system.router)
    app.include_router(system.details, dependencies=[Depends(require_key)])
    app.include_router(sandboxes.router, dependencies=[Depends(require_key)])
    app.include_router(data.router, dependencies=[Depends(require_key)])
    app.include_router(lifecycle.router, dependencies=[Depends(require_key)])
    app.include_router(images.router, dependencies=[Depends(require_key)])
    app.include_router(templates.router, dependencies=[Depends(require_key)])
    app.include_router(templates.uploads)  # its own token in the url, like a pre-signed url
    app.include_router(unsupported.router, dependencies=[Depends(require_key)])
    return app


class _Unauthorized(Exception):
    pass
