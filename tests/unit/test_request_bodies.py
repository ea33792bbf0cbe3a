"""Optional JSON bodies of the lifecycle and build routes: empty means defaults, bad input is a
400 (InvalidRequest) that names the field."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel
from starlette.requests import Request

from agentenv.api.routes import optional_body
from agentenv.errors import InvalidRequest


class Fork(BaseModel):
    count: int = 1
    timeout: int | None = None


def _request(body: bytes) -> Request:
    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": body, "more_body": False}
    return Request({"type": "http", "method": "POST", "headers": []}, receive)


def _parse(body: bytes) -> Fork:
    return asyncio.run(optional_body(_request(body), Fork))


def test_empty_body_means_defaults() -> None:
    assert _parse(b"") == Fork()
    assert _parse(b"  \n") == Fork()


def test_fields_are_parsed() -> None:
    assert _parse(b'{"count": 4, "timeout": 60, "unknown": 1}') == Fork(count=4, timeout=60)


@pytest.mark.parametrize("body, names", [
    (b'{"count": "many"}', "count"),
    (b'{"count": 2, "timeout": [1]}', "timeout"),
    (b'{"count": ', "body"),
])
def test_bad_body_names_the_field(body: bytes, names: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _parse(body)
    assert info.value.message.startswith("invalid request: ") and names in info.value.message
