"""The sandbox proxy: E2B's data-plane edge, in the API server's process.

Requests addressed to a sandbox port (by ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers or by a
``{port}-{sandboxID}.{domain}`` Host) are forwarded to that port of the sandbox's guest; every
other request goes to the API. See docs/architecture.md ("Sandbox proxy").
"""

from agentenv.proxy.http import ProxyMiddleware, SandboxProxy

__all__ = ["ProxyMiddleware", "SandboxProxy"]
