"""Create, get, list, timeout and kill, as a user of the HTTP API sees them."""

from __future__ import annotations

import datetime
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.e2e.conftest import ns_addr, run
from tests.framework import host
from tests.framework.server import ServerProcess


def test_create_run_kill_leaves_nothing(api: httpx.Client, server: ServerProcess) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "metadata": {"job": "t1"}, "envVars": {"FOO": "bar"}})
    assert r.status_code == 201, r.text
    body = r.json()
    sid = body["sandboxID"]
    assert sid.isalnum() and sid.islower() and "-" not in sid
    assert body["templateID"] == "base" and body["envdAccessToken"]

    out = run(api, sid, "echo hello $FOO; uname -r")
    assert out["exitCode"] == 0
    assert out["stdout"].splitlines()[0] == "hello bar"
    assert "cloud-amd64" in out["stdout"]  # the guest's own kernel, not the host's

    info = api.get(f"/sandboxes/{sid}").json()
    assert info["state"] == "running" and info["metadata"] == {"job": "t1"}
    assert info["cpuCount"] == 1 and info["memoryMB"] == 512
    listed = api.get("/sandboxes", params={"metadata": "job=t1"}).json()
    assert [s["sandboxID"] for s in listed] == [sid]
    assert api.get("/sandboxes", params={"metadata": "job=other"}).json() == []
    assert sid in {s["sandboxID"] for s in api.get("/sandboxes", params={"state": "running"}).json()}

    pids = host.qemu_pids(sid)
    assert len(pids) == 1
    ns, _ = ns_addr(server, sid)
    ns_inode = os.stat(f"/run/netns/{ns}").st_ino  # the namespace itself, not its reusable name
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert api.get(f"/sandboxes/{sid}").status_code == 404
    assert api.delete(f"/sandboxes/{sid}").status_code == 404
    assert host.qemu_pids(sid) == set()
    assert sid not in host.sandbox_dirs(server.data_dir)
    # the namespace goes just after the answer (its removal waits on the kernel, not the caller)
    def same_namespace() -> bool:
        try:
            return os.stat(f"/run/netns/{ns}").st_ino == ns_inode
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while same_namespace() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not same_namespace(), "namespace not freed"


def test_a_ready_shell_runs_behind_live_sandboxes_until_a_create_takes_it(api: httpx.Client,
                                                                          server: ServerProcess) -> None:
    """The warm pool restores and waits at a lower CPU priority (vmm/priority.py), so that its
    refills do not slow the sandboxes users run commands in; the one a create takes runs as
    they do."""
    if api.get("/health/details").json()["poolSize"] == 0:  # no create yet: the template is not hot
        api.delete(f"/sandboxes/{api.post('/sandboxes', json={'templateID': 'base'}).json()['sandboxID']}")
    deadline = time.monotonic() + 60
    while (d := api.get("/health/details").json())["poolReady"] < max(1, d["poolSize"]):
        assert time.monotonic() < deadline, f"the warm pool did not fill: {d}"
        time.sleep(0.1)
    live = {s["sandboxID"] for s in api.get("/v2/sandboxes", params={"state": "running,paused"}).json()}
    shells = {pid for d in host.sandbox_dirs(server.data_dir) - live for pid in host.qemu_pids(d)}
    assert shells, "a ready shell is running"
    assert all(host.cpu_nice(pid) == {10} for pid in shells), [host.cpu_nice(p) for p in shells]
    sid = api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
    try:
        (pid,) = host.qemu_pids(sid)
        assert pid in shells, "the create took the ready shell"
        assert host.cpu_nice(pid) == {0}
        assert run(api, sid, "echo up")["stdout"] == "up\n"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_each_sandbox_has_its_own_identity_and_clock(api: httpx.Client) -> None:
    ids = [api.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"] for _ in range(2)]
    try:
        seen = []
        for sid in ids:
            out = run(api, sid, "cat /run/e2b/.E2B_SANDBOX_ID; echo; cat /proc/sys/kernel/random/uuid; "
                                "head -c 16 /dev/urandom | od -An -tx1; date +%s; echo $E2B_SANDBOX_ID")["stdout"].split("\n")
            assert out[0] == sid
            assert out[4] == sid
            assert abs(int(out[3]) - time.time()) < 30, "the guest clock was not set after restore"
            seen.append((out[1], out[2]))
        assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1], "two sandboxes share random state"
    finally:
        for sid in ids:
            api.delete(f"/sandboxes/{sid}")


def test_timeout_expiry_kills(api: httpx.Client, server: ServerProcess) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    assert api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1}).status_code == 204
    end = api.get(f"/sandboxes/{sid}").json()["endAt"]
    assert end  # RFC 3339
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and api.get(f"/sandboxes/{sid}").status_code == 200:
        time.sleep(0.2)
    assert api.get(f"/sandboxes/{sid}").status_code == 404
    assert host.qemu_pids(sid) == set()


def test_a_timeout_set_while_the_network_is_updated_is_kept(api: httpx.Client) -> None:
    """An SDK's set_timeout does not wait for other operations on its sandbox. One that came
    while a network update applied its rules was answered 204 and then undone: the update
    put back the record it had read before (the sandbox was killed at the old deadline)."""
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 300}).json()["sandboxID"]
    try:
        for i in range(10):
            timeout = 900 + 60 * i
            with ThreadPoolExecutor(2) as pool:
                net = pool.submit(api.put, f"/sandboxes/{sid}/network", json={"denyOut": [f"203.0.113.{i}/32"]})
                time.sleep(0.004 * i)  # somewhere within the update
                ttl = pool.submit(api.post, f"/sandboxes/{sid}/timeout", json={"timeout": timeout})
                assert net.result().status_code == 204 and ttl.result().status_code == 204
            d = api.get(f"/sandboxes/{sid}").json()
            end = datetime.datetime.fromisoformat(d["endAt"].replace("Z", "+00:00")).timestamp()
            assert abs(end - (time.time() + timeout)) < 30, (i, d["endAt"])
            assert d["network"]["denyOut"] == [f"203.0.113.{i}/32"], (i, d["network"])
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_create_with_short_timeout_expires(api: httpx.Client) -> None:
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 2}).json()["sandboxID"]
    assert api.get(f"/sandboxes/{sid}").status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and api.get(f"/sandboxes/{sid}").status_code == 200:
        time.sleep(0.2)
    assert api.get(f"/sandboxes/{sid}").status_code == 404


def test_templates_and_health(api: httpx.Client, server: ServerProcess) -> None:
    tmpl = api.get("/templates").json()
    assert "base" in [t["templateID"] for t in tmpl]
    assert httpx.get(server.url + "/health").status_code == 204
    r = httpx.get(server.url + "/health/details")
    assert r.status_code == 401, "what the node runs is told only to its key's holders"
    details = server.details()
    assert details["accel"] in ("kvm", "tcg") and details["accelReason"]


def test_bigger_shape_gets_its_own_snapshot(api: httpx.Client) -> None:
    r = api.post("/sandboxes", json={"templateID": "base", "cpuCount": 2, "memoryMB": 768})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        out = run(api, sid, "nproc; awk '/MemTotal/ {print $2}' /proc/meminfo")["stdout"].split()
        assert out[0] == "2"
        assert 600_000 < int(out[1]) <= 768 * 1024
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_openapi_document_is_served(server: ServerProcess) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    paths = doc["paths"]
    for p in ("/sandboxes", "/sandboxes/{sandbox_id}", "/sandboxes/{sandbox_id}/timeout",
              "/sandboxes/{sandbox_id}/exec", "/sandboxes/{sandbox_id}/files", "/templates", "/health"):
        assert p in paths, p
    assert "post" in paths["/sandboxes"] and "delete" in paths["/sandboxes/{sandbox_id}"]


def test_create_retried_with_an_idempotency_key_makes_one_sandbox(api: httpx.Client, server: ServerProcess) -> None:
    """A trainer that lost the answer to a create retries with the same key: it gets the same
    sandbox (id and token), concurrently or later, and across a server restart."""
    key = f"rollout-{time.time_ns()}"
    body = {"templateID": "base", "timeout": 120, "metadata": {"k": key}}
    with ThreadPoolExecutor(3) as ex:
        answers = list(ex.map(lambda _: api.post("/sandboxes", json=body, headers={"Idempotency-Key": key}),
                              range(3)))
    assert [r.status_code for r in answers] == [201, 201, 201], [r.text for r in answers]
    assert len({(r.json()["sandboxID"], r.json()["envdAccessToken"]) for r in answers}) == 1
    assert sorted(r.headers.get("idempotent-replayed", "") for r in answers) == ["", "true", "true"]
    sid = answers[0].json()["sandboxID"]
    try:
        listed = api.get("/sandboxes", params={"metadata": f"k={key}"}).json()
        assert [s["sandboxID"] for s in listed] == [sid]
        r = api.post("/sandboxes", json={**body, "timeout": 60}, headers={"Idempotency-Key": key})
        assert r.status_code == 422 and "different create request" in r.json()["message"]
        server.stop(signal.SIGKILL)
        server.start()
        r = api.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert r.status_code == 201 and r.json()["sandboxID"] == sid and r.headers["idempotent-replayed"] == "true"
        # Paused meanwhile (auto-pause, or by hand): the retry gets it back running, as a create would.
        run(api, sid, "echo before > /tmp/replay")
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        r = api.post("/sandboxes", json=body, headers={"Idempotency-Key": key})
        assert r.status_code == 201 and r.json()["sandboxID"] == sid and r.headers["idempotent-replayed"] == "true"
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
        assert run(api, sid, "cat /tmp/replay")["stdout"] == "before\n"
    finally:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
    r = api.post("/sandboxes", json=body, headers={"Idempotency-Key": key})  # the sandbox is gone: a new one
    assert r.status_code == 201 and r.json()["sandboxID"] != sid
    api.delete(f"/sandboxes/{r.json()['sandboxID']}")


def test_a_proxy_in_the_servers_environment_does_not_catch_guest_traffic(tmp_path) -> None:
    """Cluster nodes often export HTTP_PROXY for their own downloads. The server reaches its
    guests directly whatever the environment says (here: a proxy where nothing listens)."""
    from tests.framework.net import node_cidr

    dead = "http://127.0.0.1:9"
    s = ServerProcess(tmp_path / "data", node_cidr(22), AENV_POOL_SIZE="1",
                      HTTP_PROXY=dead, http_proxy=dead, HTTPS_PROXY=dead, https_proxy=dead, ALL_PROXY=dead)
    s.start()
    try:
        with s.client() as api:
            r = api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            sid = r.json()["sandboxID"]
            assert run(api, sid, "echo through")["stdout"] == "through\n"
            # ... and so does its sandbox proxy, to the agent and to other ports.
            envd = api.get("/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
            assert envd.status_code == 204
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
    finally:
        s.kill_all()
