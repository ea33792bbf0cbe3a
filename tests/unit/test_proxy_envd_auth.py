"""The credentials the proxy checks before a request to the agent's port may wake a sandbox:
the same the guest agent accepts (tests/guest test the agent's side with the same rule)."""

from __future__ import annotations

import base64
import hashlib
import time
from urllib.parse import urlencode

from agentenv.proxy.envd_auth import carries_envd_credentials

TOKEN = "s3cret"


def signed(path: str, operation: str, expiration: int | None = None, token: str = TOKEN) -> bytes:
    raw = f"{path}:{operation}:user:{token}" + (f":{expiration}" if expiration else "")
    q = {"path": path, "username": "user",
         "signature": "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")}
    if expiration:
        q["signature_expiration"] = str(expiration)
    return urlencode(q).encode()


def test_the_agents_token_header() -> None:
    assert carries_envd_credentials(TOKEN, "POST", "/process.Process/Start", b"", {b"x-access-token": b"s3cret"})
    assert not carries_envd_credentials(TOKEN, "POST", "/process.Process/Start", b"", {b"x-access-token": b"nope"})
    assert not carries_envd_credentials(TOKEN, "GET", "/health", b"", {})
    # a wrong header fails even beside a right signature, as in the agent
    assert not carries_envd_credentials(TOKEN, "GET", "/files", signed("/a", "read"), {b"x-access-token": b"nope"})


def test_a_presigned_files_url() -> None:
    later = int(time.time()) + 600
    assert carries_envd_credentials(TOKEN, "GET", "/files", signed("/home/user/a b.txt", "read"), {})
    assert carries_envd_credentials(TOKEN, "POST", "/files", signed("/a", "write", later), {})
    assert not carries_envd_credentials(TOKEN, "POST", "/files", signed("/a", "read"), {})  # a download's
    assert not carries_envd_credentials(TOKEN, "GET", "/files", signed("/a", "read", token="other"), {})
    assert not carries_envd_credentials(TOKEN, "GET", "/files", signed("/a", "read", int(time.time()) - 1), {})
    assert not carries_envd_credentials(TOKEN, "GET", "/filesystem.Filesystem/Stat", signed("/a", "read"), {})
