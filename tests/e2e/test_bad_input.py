"""Bad requests get the right status and a message that says what to fix."""

from __future__ import annotations

import httpx

from tests.framework.server import ServerProcess


def test_unknown_template_is_404_naming_it(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"templateID": "no-such-template"})
    assert r.status_code == 404
    assert r.json() == {"code": 404, "message": r.json()["message"]}
    assert "no-such-template" in r.json()["message"]


def test_resources_out_of_range_are_400_naming_the_field(api: httpx.Client) -> None:
    for body, field in (({"cpuCount": 0}, "cpuCount"), ({"cpuCount": 999}, "cpuCount"),
                        ({"memoryMB": 64}, "memoryMB"), ({"memoryMB": 10**7}, "memoryMB"),
                        ({"timeout": -5}, "timeout"), ({"cpuCount": "many"}, "cpuCount")):
        r = api.post("/sandboxes", json={"templateID": "base", **body})
        assert r.status_code == 400, (body, r.text)
        assert field in r.json()["message"], r.text


def test_malformed_json_and_missing_fields_are_400(api: httpx.Client) -> None:
    r = api.post("/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = api.post("/sandboxes", json={"timeout": 5})
    assert r.status_code == 400 and "templateID" in r.json()["message"]


def test_wrong_or_missing_api_key_is_401(server: ServerProcess) -> None:
    for headers in ({}, {"X-API-Key": "e2b_" + "0" * 40}):
        r = httpx.get(server.url + "/sandboxes", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["message"]
    assert server.api_key.startswith("e2b_") and len(server.api_key) == 44
    assert (server.data_dir / "api_key").stat().st_mode & 0o777 == 0o600


def test_unknown_sandbox_is_404_everywhere(api: httpx.Client) -> None:
    for method, path, kw in (("GET", "/sandboxes/nosuchsandbox", {}),
                             ("DELETE", "/sandboxes/nosuchsandbox", {}),
                             ("POST", "/sandboxes/nosuchsandbox/timeout", {"json": {"timeout": 5}}),
                             ("POST", "/sandboxes/nosuchsandbox/exec", {"json": {"cmd": "true"}}),
                             ("GET", "/sandboxes/nosuchsandbox/files?path=/etc/hosts", {})):
        r = api.request(method, path, **kw)
        assert r.status_code == 404, (method, path, r.text)
        assert "nosuchsandbox" in r.json()["message"]


def test_bad_state_filter_is_400(api: httpx.Client) -> None:
    r = api.get("/sandboxes", params={"state": "sleeping"})
    assert r.status_code == 400 and "state" in r.json()["message"]


def test_text_that_is_not_unicode_is_400_and_the_listing_stays_whole(api: httpx.Client) -> None:
    """JSON can carry a lone surrogate ("\\ud800"). A sandbox created with one in its metadata
    made every listing (and its own detail) a 500 until it was killed, across restarts."""
    body = b'{"templateID": "base", "metadata": {"k": "\\ud800"}}'
    for field, raw in (("metadata", body), ("envVars", body.replace(b"metadata", b"envVars"))):
        r = api.post("/sandboxes", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and field in r.json()["message"], r.text
        assert "surrogate" in r.json()["message"]
    assert api.get("/sandboxes").status_code == 200
    assert api.get("/v2/sandboxes").status_code == 200


def test_exec_input_that_cannot_run_is_400(api: httpx.Client) -> None:
    """An empty argv and timeouts that are not a number of seconds (NaN, Infinity, 1e308,
    negative) were 500s, or a 1 ms deadline, before the sandbox was even looked up."""
    for raw in (b'{"cmd": []}', b'{"cmd": "true", "timeout": NaN}', b'{"cmd": "true", "timeout": Infinity}',
                b'{"cmd": "true", "timeout": 1e308}', b'{"cmd": "true", "timeout": -1}',
                b'{"cmd": ["echo", "\\udc80"]}'):
        r = api.post("/sandboxes/nosuchsandbox/exec", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.status_code, r.text)
        assert r.json()["code"] == 400 and ("cmd" in r.json()["message"] or "timeout" in r.json()["message"]), r.text
