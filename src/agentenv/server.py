"""Composition root: settings → orchestrator → API behind the sandbox proxy → uvicorn.

The only module (with cli/) that reads configuration; everything below receives values.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import uvicorn

from agentenv.config import Settings
from agentenv.errors import ProvisioningError
from agentenv.images import artifacts_present
from agentenv.images.registry import RegistrySettings
from agentenv.orchestrator import Orchestrator, Template, TemplateCatalog
from agentenv.orchestrator.ids import new_api_key
from agentenv.proxy import ProxyMiddleware, SandboxProxy

DEFAULT_TEMPLATE = "base"


def api_key_for(settings: Settings) -> str:
    """The node's API key: configured, or generated once and kept 0600 in the data dir."""
    if settings.api_key:
        return settings.api_key
    path = settings.data_dir / "api_key"
    if path.exists():
        return path.read_text().strip()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key = new_api_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def register_default_template(settings: Settings) -> None:
    """Point the `base` template at the provisioned images (kept up to date with `aenv setup`)."""
    artifacts = artifacts_present(settings.cache)
    if artifacts is None:
        raise ProvisioningError(f"no guest images under {settings.cache}; run `aenv setup` first")
    catalog = TemplateCatalog(settings.data_dir / "templates")
    try:
        current = catalog.get(DEFAULT_TEMPLATE)
        if current.artifacts != artifacts:
            catalog.put(Template(name=DEFAULT_TEMPLATE, artifacts=artifacts))
    except Exception:  # noqa: BLE001 — absent or unreadable: (re)write it
        catalog.put(Template(name=DEFAULT_TEMPLATE, artifacts=artifacts))
    # Templates from images share the kernel, initramfs and tools drive: follow `aenv setup`.
    for t in catalog.list():
        if t.image is not None:
            shared = replace(artifacts, rootfs=t.artifacts.rootfs)
            if t.artifacts != shared:
                catalog.put(replace(t, artifacts=shared))


def build_app(settings: Settings) -> ProxyMiddleware:
    """The API behind the sandbox proxy, over one orchestrator. Requests for a sandbox port
    ({port}-{id}.{domain} Host, or E2b-Sandbox-Id/-Port headers as E2B SDKs send them with
    E2B_SANDBOX_URL) go to the proxy before FastAPI sees them: a command's round trip does not
    pay for the framework's middleware stack on every message of its streamed response."""
    from agentenv.api import create_app

    register_default_template(settings)
    try:
        registry = RegistrySettings.from_env()
    except ValueError as exc:
        raise ProvisioningError(f"registry settings: {exc}") from exc
    orch = Orchestrator(settings, registry)
    proxy = SandboxProxy(orch, settings.domain)
    return ProxyMiddleware(create_app(orch, api_key_for(settings), on_stop=proxy.aclose), proxy)


def serve(settings: Settings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(settings)
    tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)} if settings.tls_cert else {}
    # The event loop the server is tested with: uvicorn would take uvloop whenever it is
    # installed (`uvicorn[standard]` brings it), and measured no faster here. No Server header
    # of its own: a proxied response carries the sandbox's (proxy/headers.py).
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", loop="asyncio",
                timeout_keep_alive=650, timeout_graceful_shutdown=10, server_header=False, **tls)




if __name__ == "__main__":
    serve(Settings.from_env())
