"""Which requests the sandbox proxy takes, and for which sandbox and port (E2B's rules)."""

from __future__ import annotations

import pytest

from agentenv.proxy.http import SandboxProxy, _Reject


def scope(host: str, **headers: str) -> dict:
    hs = [(b"host", host.encode())] + [(k.replace("_", "-").lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    return {"type": "http", "headers": hs}


def target(s: dict, domain: str | None = None) -> tuple[str, int] | None:
    return SandboxProxy(None, domain).target(s)  # type: ignore[arg-type]


def test_host_names_route_to_port_and_sandbox() -> None:
    assert target(scope("8000-iabc123.aenv.test")) == ("iabc123", 8000)
    assert target(scope("49983-iabc123.aenv.test:443")) == ("iabc123", 49983)
    assert target(scope("8000-iabc123.aenv.test"), domain="aenv.test") == ("iabc123", 8000)
    assert target(scope("8000-iabc123.other.test"), domain="aenv.test") is None


@pytest.mark.parametrize("host,domain", [
    ("8000-IABC123.aenv.test", None), ("8000-iabc123.AENV.test", "aenv.test"), ("8000-iabc123.aenv.test.", "aenv.test"),
    ("8000-iabc123.aenv.test", "Aenv.Test."), ("8000-iabc123.localhost:3000", "localhost:3000"),
])
def test_host_names_are_matched_as_dns_names(host: str, domain: str | None) -> None:
    """Case-insensitive, a trailing dot allowed; a domain with a port (E2B_DOMAIN=localhost:3000)
    is matched with the Host's port."""
    assert target(scope(host), domain=domain) == ("iabc123", 8000)
    assert target(scope("8000-iabc123.localhost:3001"), domain="localhost:3000") is None


def test_headers_route_when_the_host_is_not_a_sandbox_host() -> None:
    s = scope("127.0.0.1:8000", E2b_Sandbox_Id="iabc", E2b_Sandbox_Port="49983")
    assert target(s) == ("iabc", 49983)
    assert target(scope("api.example.com", E2b_Sandbox_Id="iabc", E2b_Sandbox_Port="8080")) == ("iabc", 8080)


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "api.aenv.test", "8000-x", "abc-def.aenv.test"])
def test_api_requests_pass_through(host: str) -> None:
    assert target(scope(host)) is None


@pytest.mark.parametrize("headers", [
    {"E2b_Sandbox_Id": "iabc"}, {"E2b_Sandbox_Port": "49983"},
    {"E2b_Sandbox_Id": "I-Bad", "E2b_Sandbox_Port": "49983"},
    {"E2b_Sandbox_Id": "iabc", "E2b_Sandbox_Port": "http"},
    {"E2b_Sandbox_Id": "iabc", "E2b_Sandbox_Port": "70000"},
    {"E2b_Sandbox_Id": "iabc", "E2b_Sandbox_Port": "\u00b2"},  # a digit to str.isdigit, not to int
])
def test_malformed_routing_headers_are_400(headers: dict[str, str]) -> None:
    with pytest.raises(_Reject) as e:
        target(scope("127.0.0.1", **headers))
    assert e.value.status == 400 and e.value.body["code"] == 400
