"""E2B's list pagination: ``limit`` items per page, the cursor of the next page in the
``X-Next-Token`` header (absent on the last page), given back as ``nextToken``.

A cursor is the last item's (time, id), so a page stays right while items are added or
removed between requests; it is opaque to clients (base64)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import TypeVar

from agentenv.errors import InvalidRequest

T = TypeVar("T")
Cursor = tuple[float, str]
MAX_LIMIT = 100


def check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")


def encode(cursor: Cursor, ascending: bool = False) -> str:
    raw = f"{cursor[0]!r}__{cursor[1]}" + ("__asc" if ascending else "")
    return base64.urlsafe_b64encode(raw.encode()).decode()


def decode(token: str) -> Cursor:
    try:
        parts = base64.urlsafe_b64decode(token.encode() + b"=" * (-len(token) % 4)).decode().split("__")
        return float(parts[0]), parts[1]
    except (binascii.Error, UnicodeDecodeError, ValueError, IndexError) as exc:
        raise InvalidRequest("nextToken is not a token this server issued") from exc


def page(items: Sequence[T], cursor: Callable[[T], Cursor], limit: int, token: str | None,
         ascending: bool = False) -> tuple[list[T], str | None]:
    """One page of ``items`` (in any order) sorted by ``cursor``, newest first unless
    ``ascending``, after ``token``; and the next page's token, None on the last page."""
    ordered = sorted(items, key=cursor, reverse=not ascending)
    if token:
        after = decode(token)
        ordered = [x for x in ordered if (cursor(x) > after if ascending else cursor(x) < after)]
    out = ordered[:limit]
    return out, encode(cursor(out[-1]), ascending) if len(ordered) > limit else None
