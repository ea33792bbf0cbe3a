"""Whether a request for a sandbox's guest agent (envd, port 49983) carries its credentials.

The agent checks them itself, so a request without them is forwarded and refused in the
guest. But a paused sandbox with auto-resume must not be woken by such a request: a wake
costs the node a VM's memory and CPU, and anyone who knows a sandbox id could keep paused
sandboxes awake. So the proxy checks the same credentials the agent does before it wakes
one: the ``X-Access-Token`` header, or else a ``/files`` URL signature (E2B's ``v1_``
pre-signed download and upload URLs). The guest shares no code with the host, so the
signature rule is written here a second time; both follow the E2B wire protocol (§4.7).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from urllib.parse import parse_qs


def _signature(token: str, path: str, operation: str, username: str, expiration: str | None) -> str:
    raw = f"{path}:{operation}:{username}:{token}" + (f":{expiration}" if expiration else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def carries_envd_credentials(token: str, method: str, path: str, query: bytes, headers: dict[bytes, bytes]) -> bool:
    """True if the request would pass the guest agent's token or signature check."""
    sent = headers.get(b"x-access-token")
    if sent is not None:
        return hmac.compare_digest(sent, token.encode())
    if path != "/files" or method not in ("GET", "POST"):
        return False
    q = {k: v[0] for k, v in parse_qs(query.decode("latin-1"), keep_blank_values=True).items()}
    expiration = q.get("signature_expiration") or None
    if expiration is not None and (not expiration.isdigit() or int(expiration) < time.time()):
        return False
    expected = _signature(token, q.get("path", ""), "read" if method == "GET" else "write", q.get("username", ""),
                          expiration)
    return hmac.compare_digest(q.get("signature", "").encode(), expected.encode())
