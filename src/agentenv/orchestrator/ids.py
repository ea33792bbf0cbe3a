"""Identifiers and secrets.

Sandbox ids are 20 lowercase alphanumerics with no '-' or '.', so that they fit in host names
of the form ``{port}-{id}.{domain}`` (E2B's proxy convention).
"""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    return "i" + "".join(secrets.choice(_ALPHABET) for _ in range(19))


def new_access_token() -> str:
    return secrets.token_hex(24)


def new_api_key() -> str:
    """E2B's key shape: ``e2b_`` + 40 lowercase hex (older SDKs validate it)."""
    return "e2b_" + secrets.token_hex(20)


def is_sandbox_id(value: str) -> bool:
    return 1 <= len(value) <= 64 and all(c in _ALPHABET for c in value)
