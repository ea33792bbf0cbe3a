"""Control-plane details E2B clients rely on, checked on the wire: error bodies and statuses,
v2 list pagination headers and filters, refresh, templates, metrics of several sandboxes."""

from __future__ import annotations

import os
import shlex
import signal
import time
from datetime import datetime
from urllib.parse import quote, urlencode

import httpx

from tests.e2b.conftest import PY_LATEST, SDK
from tests.framework import host
from tests.framework.server import ServerProcess


def _create(api: httpx.Client, **body: object) -> dict:
    r = api.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def test_create_answers_and_refusals(api: httpx.Client) -> None:
    sb = _create(api, timeout=60, autoPause=True, autoResume={"enabled": True}, secure=True,
                 mcp=None, metadata={"m": "1"}, envVars={"A": "1"})
    try:
        assert set(sb) >= {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken", "domain"}
        assert sb["envdVersion"] == "0.6.13" and sb["domain"] == "aenv.test" and len(sb["envdAccessToken"]) >= 32
        assert "-" not in sb["sandboxID"] and "." not in sb["sandboxID"]
        d = api.get(f"/sandboxes/{sb['sandboxID']}").json()
        assert d["lifecycle"] == {"autoResume": True, "onTimeout": "pause"}
        assert d["allowInternetAccess"] is True and d["state"] == "running" and d["metadata"] == {"m": "1"}
        for key in ("startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "envdVersion", "clientID"):
            assert key in d
    finally:
        assert api.delete(f"/sandboxes/{sb['sandboxID']}").status_code == 204
    refusals = [
        ({"timeout": 25 * 3600}, "Timeout cannot be greater than 24 hours"),
        ({"timeout": -1}, "timeout"),
        ({"autoPauseMemory": False}, "autoPauseMemory requires autoPause"),
        ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}, "autoResume"),
        ({"volumeMounts": [{"name": "v", "path": "/mnt"}]}, "volumes"),
        ({"network": {"dnsServers": ["1.1.1.1"]}}, "dnsServers"),
        ({"network": {"httpsPorts": [3000]}}, "httpsPorts"),  # (was accepted, then plain HTTP reached TLS)
        ({"network": {"allowOut": ["2001:db8::/32"]}}, "IPv6"),
    ]
    for body, words in refusals:
        r = api.post("/v2/sandboxes", json={"templateID": "base", **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["code"] == 400 and words in r.json()["message"], (body, r.text)
    r = api.post("/sandboxes", json={"templateID": "no-such-template"})
    assert r.status_code == 404 and r.json()["code"] == 404 and "no-such-template" in r.json()["message"]
    # A browser (the JS SDK in a web page): the preflight passes, and paging's header is readable.
    r = api.options("/v2/sandboxes", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "x-api-key,content-type,browser"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "https://app.example"), r.headers
    assert "x-api-key" in r.headers["access-control-allow-headers"].lower()
    r = api.get("/v2/sandboxes", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "x-next-token" in r.headers["access-control-expose-headers"].lower()
    # Volumes and secrets: not "no such volume" (a 404 the SDKs read so), but not supported.
    for method, path in (("GET", "/volumes"), ("DELETE", "/volumes/v1"), ("POST", "/secrets"), ("GET", "/secrets/s")):
        r = api.request(method, path)
        assert r.status_code == 501 and "not supported" in r.json()["message"], (method, path, r.text)


def test_unknown_sandbox_is_404_with_e2b_body(api: httpx.Client) -> None:
    for method, path, body in [("GET", "/sandboxes/nonexistingsandbox", None),
                               ("DELETE", "/sandboxes/nonexistingsandbox", None),
                               ("POST", "/sandboxes/nonexistingsandbox/timeout", {"timeout": 10}),
                               ("POST", "/sandboxes/nonexistingsandbox/refreshes", {"duration": 10}),
                               ("GET", "/sandboxes/nonexistingsandbox/metrics", None),
                               ("PUT", "/sandboxes/nonexistingsandbox/network", {})]:
        r = api.request(method, path, json=body)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json() == {"code": 404, "message": "sandbox 'nonexistingsandbox' not found"}


def test_v2_list_pages_filters_and_headers(api: httpx.Client) -> None:
    tag = f"t{time.time_ns()}"
    meta = {"tag": tag, "odd key": "a&b=c d"}
    ids = [_create(api, timeout=120, metadata=meta)["sandboxID"] for _ in range(3)]
    try:
        # The SDK's double encoding: quote() keys and values, urlencode, then the query is encoded again.
        q = urlencode({quote(k): quote(v) for k, v in meta.items()})
        r = api.get("/v2/sandboxes", params={"metadata": q, "limit": 2})
        assert r.status_code == 200 and [s["sandboxID"] for s in r.json()] == ids[::-1][:2]
        token = r.headers["X-Next-Token"]
        assert int(r.headers["X-Total-Running"]) >= 3
        r = api.get("/v2/sandboxes", params={"metadata": q, "limit": 2, "nextToken": token})
        assert [s["sandboxID"] for s in r.json()] == ids[:1] and "X-Next-Token" not in r.headers
        r = api.get("/v2/sandboxes", params={"metadata": q, "order": "asc"})
        assert [s["sandboxID"] for s in r.json()] == ids
        r = api.get("/v2/sandboxes", params={"metadata": q, "state": "paused"})
        assert r.json() == []
        r = api.get("/v2/sandboxes", params={"metadata": q, "template": "base", "state": "running,paused"})
        assert len(r.json()) == 3
        assert api.get("/v2/sandboxes", params={"metadata": q, "template": "nope"}).json() == []
        started = api.get(f"/sandboxes/{ids[1]}").json()["startedAt"]
        r = api.get("/v2/sandboxes", params={"metadata": q, "startedAfter": started})
        assert sorted(s["sandboxID"] for s in r.json()) == sorted(ids[1:])
        assert [s["sandboxID"] for s in api.get("/sandboxes", params={"metadata": q}).json()] == ids[::-1]
        for bad in ({"limit": 0}, {"limit": 101}, {"template": "base:v1"}, {"nextToken": "!!"},
                    {"state": "sleeping"}, {"metadata": "novalue"}, {"order": "up"}):
            r = api.get("/v2/sandboxes", params=bad)
            assert r.status_code == 400 and r.json()["code"] == 400, (bad, r.text)
    finally:
        for sid in ids:
            api.delete(f"/sandboxes/{sid}")


def test_refresh_extends_never_shortens(api: httpx.Client) -> None:
    sid = _create(api, timeout=100)["sandboxID"]
    try:
        end0 = api.get(f"/sandboxes/{sid}").json()["endAt"]
        assert api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 10}).status_code == 204
        assert api.get(f"/sandboxes/{sid}").json()["endAt"] == end0
        assert api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 1000}).status_code == 204
        assert api.get(f"/sandboxes/{sid}").json()["endAt"] > end0
        assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": -5}).status_code == 400
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_connect_to_a_running_sandbox_extends_it_by_300_s_when_no_timeout_is_given(api: httpx.Client) -> None:
    """SDK 2.63 and the JS SDK omit ``timeout`` on connect when the caller gives none; E2B then
    extends the time to live to at least 300 s from now (never shortens it)."""
    sid = _create(api, timeout=20)["sandboxID"]
    try:
        r = api.post(f"/v2/sandboxes/{sid}/connect", json={})
        assert r.status_code == 200, r.text
        left = _seconds_left(api.get(f"/sandboxes/{sid}").json()["endAt"])
        assert 290 < left <= 301, left
        assert api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 30}).status_code == 200
        assert _seconds_left(api.get(f"/sandboxes/{sid}").json()["endAt"]) > 290, "never shortened"
    finally:
        api.delete(f"/sandboxes/{sid}")


def _seconds_left(end_at: str) -> float:
    return datetime.fromisoformat(end_at.replace("Z", "+00:00")).timestamp() - time.time()


def test_the_deprecated_resume_route_sets_auto_pause(api: httpx.Client) -> None:
    """``POST /sandboxes/{id}/resume`` with ``autoPause`` (ResumedSandbox): at its next timeout
    the sandbox is paused, not killed."""
    sid = _create(api, timeout=300)["sandboxID"]
    try:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        r = api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 60})
        assert r.status_code == 404 and "is paused" in r.json()["message"], r.text  # as E2B answers it
        r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 3, "autoPause": True})
        assert r.status_code == 201, r.text
        assert api.get(f"/sandboxes/{sid}").json()["lifecycle"]["onTimeout"] == "pause"
        deadline = time.monotonic() + 20
        while api.get(f"/sandboxes/{sid}").json()["state"] != "paused" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused", "paused at its timeout, not killed"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_v1_list_shows_running_sandboxes_only(api: httpx.Client) -> None:
    """SDK 1.x lists with the v1 route, which E2B answers with running sandboxes only."""
    running, paused = _create(api, metadata={"v1list": "yes"})["sandboxID"], \
        _create(api, metadata={"v1list": "yes"})["sandboxID"]
    try:
        assert api.post(f"/sandboxes/{paused}/pause").status_code == 204
        q = {"metadata": "v1list=yes"}
        assert [s["sandboxID"] for s in api.get("/sandboxes", params=q).json()] == [running]
        both = api.get("/sandboxes", params={**q, "state": "running,paused"}).json()
        assert {s["sandboxID"] for s in both} == {running, paused}
        v2 = api.get("/v2/sandboxes", params=q).json()
        assert {s["sandboxID"] for s in v2} == {running, paused}, "v2 lists both by default"
    finally:
        for sid in (running, paused):
            api.delete(f"/sandboxes/{sid}")


# Run in a guest (as root, in the background): half a second later, stop the guest agent's
# supervisor and kill the agent (the image has no pkill).
STOP_AGENT = """
import os, signal, time
time.sleep(0.5)
def pids(name):
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\\0")
            except OSError:
                continue
            if any(a.endswith(name) for a in argv):
                yield int(p)
for p in pids(b"/agent-loop"):
    os.kill(p, signal.SIGSTOP)
for p in pids(b"/agent.py"):
    os.kill(p, signal.SIGKILL)
"""


def test_templates_and_metrics_of_several_sandboxes(sdk: SDK, api: httpx.Client) -> None:
    t = api.get("/templates").json()
    base = next(x for x in t if x["templateID"] == "base")
    assert base["aliases"] == ["base"] and base["buildStatus"] == "ready" and base["envdVersion"] == "0.6.13"
    assert base["isDefault"] is True
    assert api.get("/templates/aliases/base").json() == {"templateID": "base", "public": True}
    assert api.get("/templates/aliases/nope").status_code == 404
    # A name whose first build has not run yet is taken: Template.exists says so.
    reserved = api.post("/v3/templates", json={"name": "cp-reserved"})
    assert reserved.status_code == 202, reserved.text
    try:
        out = sdk.python(PY_LATEST, """
            import json, os, httpx
            from e2b import Template
            from e2b.api.client.models.template_with_builds import TemplateWithBuilds
            o = {"base": Template.exists("base"), "nope": Template.exists("nope"),
                 "reserved": Template.exists("cp-reserved")}
            for name in ("base", "cp-reserved"):  # GET /templates/{id} as the SDK's client parses it
                r = httpx.get(os.environ["E2B_API_URL"] + "/templates/" + name,
                              headers={"X-API-Key": os.environ["E2B_API_KEY"]})
                t = TemplateWithBuilds.from_dict(r.json())
                o[name + "_builds"] = [[str(b.build_id), b.status.value] for b in t.builds]
                o[name + "_build_id"] = t.build_id
            print(json.dumps(o))
        """)
    finally:
        api.delete("/templates/cp-reserved")
    assert {k: out[k] for k in ("base", "nope", "reserved")} == {"base": True, "nope": False, "reserved": True}
    assert out["base_builds"] == [[out["base_build_id"], "ready"]]
    assert out["cp-reserved_builds"] == [[reserved.json()["buildID"], "waiting"]]
    assert api.get("/templates/aliases/cp-reserved").status_code == 404, "deleted with its build"
    ids = [_create(api, timeout=60)["sandboxID"] for _ in range(2)]
    # A third whose guest agent is gone (stopped with its supervisor, so nothing restarts it):
    # its metrics cannot be read, and it is left out of the batch, which answers for the others.
    dead = _create(api, timeout=60)["sandboxID"]
    # A fourth whose guest tools print what the metrics do not expect (the user's to change:
    # here `stat`): left out too. Before, its parse error made the whole batch a 500.
    odd = _create(api, timeout=60)["sandboxID"]
    try:
        r = api.post(f"/sandboxes/{dead}/exec", json={"user": "root", "cmd": (
            f"nohup python3 -c {shlex.quote(STOP_AGENT)} >/dev/null 2>&1 &")})
        assert r.json()["exitCode"] == 0
        deadline = time.monotonic() + 30  # the stopper runs in the background: poll until it has
        while api.post(f"/sandboxes/{dead}/exec", json={"cmd": "true"}).status_code < 500:
            assert time.monotonic() < deadline, "the guest agent still answers"
            time.sleep(0.5)
        r = api.post(f"/sandboxes/{odd}/exec", json={"user": "root", "cmd": (
            "mv /usr/bin/stat /usr/bin/stat.real && printf '#!/bin/sh\\necho not numbers\\n' > /usr/bin/stat"
            " && chmod +x /usr/bin/stat && stat -f /")})
        assert r.json()["stdout"] == "not numbers\n", r.text
        r = api.get("/sandboxes/metrics", params={"sandbox_ids": ",".join([*ids, odd, dead, "inotthere"])})
        assert r.status_code == 200, r.text
        got = r.json()["sandboxes"]
        assert sorted(got) == sorted(ids)
        for m in got.values():
            assert m["cpuCount"] == 1 and 0 < m["memUsed"] < m["memTotal"] and 0 < m["diskUsed"] < m["diskTotal"]
        r = api.get(f"/sandboxes/{odd}/metrics")
        assert r.status_code >= 500 and "metrics did not read as expected" in r.json()["message"], r.text
    finally:
        for sid in [*ids, dead, odd]:
            api.delete(f"/sandboxes/{sid}")


def test_api_key_is_required_with_e2b_body(e2b_server: ServerProcess) -> None:
    for headers in ({}, {"X-API-Key": "e2b_" + "0" * 40}):
        r = httpx.get(e2b_server.url + "/v2/sandboxes", headers=headers)
        assert r.status_code == 401 and r.json()["code"] == 401 and "API key" in r.json()["message"]
    assert e2b_server.api_key.startswith("e2b_") and len(e2b_server.api_key) == 44


def test_a_failed_sandbox_is_an_error_the_sdk_raises_not_one_it_cannot_parse(sdk: SDK, api: httpx.Client) -> None:
    """A sandbox whose QEMU died: the SDKs know only running and paused, so list leaves it out
    and get_info raises with the reason (410). Pause and connect raise SandboxNotFoundException
    (404, as E2B answers for a sandbox that died; a 409 made pause return False, "already
    paused", and connect raise a generic error); kill clears the record."""
    sid = _create(api, timeout=120, metadata={"t": "failed"})["sandboxID"]
    (pid,) = host.qemu_pids(sid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and api.get(f"/sandboxes/{sid}").status_code == 200:
        time.sleep(0.1)
    assert api.get("/sandboxes", params={"state": "error"}).json()[0]["sandboxID"] == sid
    out = sdk.python(PY_LATEST, f"""
        import json
        from e2b import Sandbox, SandboxQuery
        o = {{"listed": [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={{"t": "failed"}})).next_items()]}}
        try:
            Sandbox.get_info("{sid}")
        except Exception as e:
            o["raised"] = [type(e).__name__, str(e)]
        for name, call in (("pause", lambda: Sandbox.pause("{sid}")), ("connect", lambda: Sandbox.connect("{sid}"))):
            try:
                o[name] = call()
            except Exception as e:
                o[name] = type(e).__name__
        o["killed"] = Sandbox.kill("{sid}")
        print(json.dumps(o))
    """)
    assert out["listed"] == []
    assert out["raised"][0] == "SandboxException" and "QEMU exited" in out["raised"][1], out
    assert out["pause"] == out["connect"] == "SandboxNotFoundException", out
    assert out["killed"] is True
    assert api.get(f"/sandboxes/{sid}").status_code == 404
