"""Template builds from steps (issue #5 parts 3-4), on real microVMs: steps run in a temporary
sandbox, the result is snapshotted with memory, sandboxes of it start with the start command
running; a layer cache makes rebuilds run only the changed steps."""

from __future__ import annotations

import hashlib
import io
import json
import signal
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import run
from tests.framework import host
from tests.framework.net import node_cidr
from tests.framework.server import ServerProcess, all_sandboxes

HTTP_READY = '[ -n "$(ss -Htuln sport = :8000)" ]'  # what the E2B SDK's wait_for_port(8000) renders


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Its own node: one test restarts it."""
    s = ServerProcess(tmp_path_factory.mktemp("buildnode") / "data", node_cidr(27, 24),
                      AENV_BUILD_STEP_TIMEOUT="20")
    s.start()
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def api(node: ServerProcess) -> Iterator[httpx.Client]:
    with node.client() as c:
        yield c


def tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def upload(api: httpx.Client, template_id: str, files: dict[str, bytes]) -> str:
    """What the SDK does for a COPY: ask whether the hash is stored, PUT the tar.gz if not."""
    h = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()
    r = api.get(f"/templates/{template_id}/files/{h}")
    assert r.status_code == 201, r.text
    if not r.json()["present"]:
        put = httpx.put(r.json()["url"], content=tar_gz(files))  # no API key: the url carries a token
        assert put.status_code in (200, 201, 204), put.text
        assert api.get(f"/templates/{template_id}/files/{h}").json()["present"] is True
    return h


def request_build(api: httpx.Client, name: str) -> tuple[str, str]:
    r = api.post("/v3/templates", json={"name": name})
    assert r.status_code == 202, r.text
    return r.json()["templateID"], r.json()["buildID"]


def wait_build(api: httpx.Client, tid: str, bid: str, timeout: float = 600) -> tuple[dict[str, Any], list[dict]]:
    """Poll like the SDK (logsOffset), until ready or error; returns (last status, all entries)."""
    entries: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = api.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": len(entries)})
        assert r.status_code == 200, r.text
        st = r.json()
        entries += st["logEntries"]
        if st["status"] in ("ready", "error") and not st["logEntries"]:
            return st, entries
        time.sleep(0.2)
    raise AssertionError(f"build {bid} did not finish in {timeout}s: {entries[-10:]}")


def build(api: httpx.Client, name: str, body: dict[str, Any], files: dict[int, dict[str, bytes]] | None = None,
          timeout: float = 600) -> tuple[dict[str, Any], list[dict], float]:
    """A whole build as the SDK drives it; ``files`` maps a step index to the files of its COPY."""
    tid, bid = request_build(api, name)
    for i, fs in (files or {}).items():
        body["steps"][i]["filesHash"] = upload(api, tid, fs)
    t0 = time.monotonic()
    r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "base", **body})
    assert r.status_code == 202, r.text
    st, entries = wait_build(api, tid, bid, timeout)
    return st, entries, time.monotonic() - t0


def messages(entries: list[dict]) -> list[str]:
    return [e["message"] for e in entries]


def build_sandboxes(api: httpx.Client) -> list[str]:
    return [s["sandboxID"] for s in all_sandboxes(api) if "agentenv.build" in (s.get("metadata") or {})]


def envd_processes(node: ServerProcess, api: httpx.Client, sid: str) -> list[dict]:
    token = api.get(f"/sandboxes/{sid}").json()["envdAccessToken"]
    r = httpx.post(f"{node.url}/process.Process/List", json={}, headers={
        "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": token,
        "Connect-Protocol-Version": "1"})
    assert r.status_code == 200, r.text
    return r.json()["processes"]  # type: ignore[no-any-return]


def test_built_template_has_files_env_workdir_user_and_a_running_start_command(
        api: httpx.Client, node: ServerProcess) -> None:
    body = {
        "steps": [
            {"type": "ENV", "args": ["GREETING", "hello", "OTHER", "two words"]},
            {"type": "RUN", "args": ["useradd -m -s /bin/bash builder && mkdir -p /srv/app && chmod 777 /srv/app",
                                     "root"]},
            {"type": "COPY", "args": ["site", "/srv/app/", "", ""]},
            {"type": "WORKDIR", "args": ["/srv/app"]},
            {"type": "USER", "args": ["builder"]},
            {"type": "RUN", "args": ["echo \"$GREETING-$(whoami)-$(pwd)\" >> runs.txt"]},
        ],
        "startCmd": "python3 -m http.server 8000",
        "readyCmd": HTTP_READY,
    }
    files = {2: {"site/index.html": b"hi from copy\n", "site/sub/x.txt": b"nested\n"}}
    st, entries, took = build(api, "tb-app", body, files)
    assert st["status"] == "ready", (st, messages(entries)[-20:])
    print(f"\nbuild tb-app (6 steps, start+ready): {took:.1f}s")
    assert build_sandboxes(api) == [], "the build's sandbox must be gone"
    info = api.get("/templates/tb-app").json()
    assert info["templateID"] == "tb-app" and info["buildID"] == st["buildID"] and info["buildStatus"] == "ready"
    assert "tb-app" in [t["templateID"] for t in api.get("/templates").json()]
    assert api.get("/templates/aliases/tb-app").status_code == 200
    assert api.get("/snapshots").json() == [], "built templates are not listed as snapshots"

    r = api.post("/sandboxes", json={"templateID": "tb-app", "timeout": 300})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        out = run(api, sid, "whoami; pwd; echo $GREETING/$OTHER; cat runs.txt index.html sub/x.txt; "
                            "stat -c %U index.html")
        assert out["exitCode"] == 0, out
        assert out["stdout"].splitlines() == ["builder", "/srv/app", "hello/two words",
                                              "hello-builder-/srv/app", "hi from copy", "nested", "user"]
        # The start command was running when the template was snapshotted: it answers at once.
        page = httpx.get(f"{node.url}/index.html", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
        assert page.status_code == 200 and page.text == "hi from copy\n", page.text
        procs = envd_processes(node, api, sid)
        start = [p for p in procs if p.get("tag") == "start"]
        assert start and "http.server" in " ".join(start[0]["config"]["args"]), procs
        pid = start[0]["pid"]
        assert run(api, sid, f"kill -0 {pid} && echo alive", user="root")["stdout"] == "alive\n"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_rebuild_with_the_last_step_changed_reuses_the_cached_steps(api: httpx.Client) -> None:
    def body(last: str) -> dict[str, Any]:
        return {"steps": [
            {"type": "RUN", "args": ["echo ran >> /home/user/count.txt"]},
            {"type": "ENV", "args": ["K", "v"]},
            {"type": "RUN", "args": ["sleep 2; echo $K > /home/user/k.txt"]},
            {"type": "RUN", "args": [f"echo {last} > /home/user/last.txt"]},
        ]}

    st1, entries1, t1 = build(api, "tb-cache", body("first"))
    assert st1["status"] == "ready", messages(entries1)[-20:]
    assert not any(m.startswith("CACHED") for m in messages(entries1))
    st2, entries2, t2 = build(api, "tb-cache", body("second"))
    assert st2["status"] == "ready", messages(entries2)[-20:]
    print(f"\nbuild tb-cache (3 RUN + 1 ENV): {t1:.1f}s; rebuild with the last step changed: {t2:.1f}s")
    cached = [m for m in messages(entries2) if m.startswith("CACHED")]
    assert len(cached) == 3 and "echo ran" in cached[0] and "ENV K=v" in cached[1], cached
    assert not any(m.startswith("CACHED") and "last.txt" in m for m in messages(entries2))
    assert t2 < t1
    assert st2["buildID"] != st1["buildID"]
    assert api.get("/templates/tb-cache").json()["buildID"] == st2["buildID"]
    sid = api.post("/sandboxes", json={"templateID": "tb-cache"}).json()["sandboxID"]
    try:
        out = run(api, sid, "cat /home/user/count.txt /home/user/k.txt /home/user/last.txt")["stdout"]
        assert out == "ran\nv\nsecond\n", "cached steps must not run again"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_failing_run_step_fails_the_build_with_its_output_and_leaves_nothing(api: httpx.Client,
                                                                           node: ServerProcess) -> None:
    st, entries, _ = build(api, "tb-fail", {"steps": [
        {"type": "RUN", "args": ["echo fine"]},
        {"type": "RUN", "args": ["echo about-to-fail; echo oops >&2; exit 3"]},
    ]})
    assert st["status"] == "error"
    msg = st["reason"]["message"]
    assert "step 2" in msg and "exit code 3" in msg and "oops" in msg and "about-to-fail" in msg, msg
    assert st["reason"]["step"] == "2"
    assert build_sandboxes(api) == []
    sid = next(m.split()[-1] for m in messages(entries) if m.startswith("running in sandbox "))
    assert host.qemu_pids(sid) == set() and not (node.data_dir / "sandboxes" / sid).exists()
    assert api.get("/templates/aliases/tb-fail").status_code == 404
    assert api.post("/sandboxes", json={"templateID": "tb-fail"}).status_code == 404
    # invalid specs are refused at once, naming the step
    tid, bid = request_build(api, "tb-bad")
    r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "base", "steps": [
        {"type": "RUN", "args": ["true"]}, {"type": "ENV", "args": ["ONLY_KEY"]}]})
    assert r.status_code == 400 and "step 2" in r.json()["message"], r.text
    assert api.get("/templates/nope/builds/nope/status").status_code == 404
    assert api.post("/v3/templates", json={"name": "base"}).status_code == 400


def test_ready_command_that_never_succeeds_fails_after_its_bound(api: httpx.Client) -> None:
    t0 = time.monotonic()
    st, entries, _ = build(api, "tb-never", {
        "steps": [], "startCmd": "sleep 1000", "readyCmd": "echo not-ready-yet; exit 1", "readyTimeout": 3})
    assert st["status"] == "error", messages(entries)[-10:]
    msg = st["reason"]["message"]
    assert "ready command did not succeed within 3" in msg and "not-ready-yet" in msg, msg
    assert time.monotonic() - t0 < 60
    assert build_sandboxes(api) == []


def test_a_run_step_that_never_ends_fails_the_build_after_its_bound(api: httpx.Client) -> None:
    """A RUN step had no bound: a hung command held the build (and one of the node's build
    slots) for the 24 h life of its sandbox, and the template could not even be deleted."""
    t0 = time.monotonic()
    st, entries, _ = build(api, "tb-hang", {"steps": [{"type": "RUN", "args": ["echo started; sleep 100000"]}]})
    assert st["status"] == "error", messages(entries)[-10:]
    msg = st["reason"]["message"]
    assert "did not finish within 20 s (AENV_BUILD_STEP_TIMEOUT)" in msg and "started" in msg, msg
    assert st["reason"]["step"] == "1"
    assert time.monotonic() - t0 < 120
    assert build_sandboxes(api) == []


def test_deleting_a_template_cancels_its_build(api: httpx.Client, node: ServerProcess) -> None:
    """A build could not be stopped: DELETE refused while it ran ("wait for the build to
    end"). Now it cancels the build, whose sandbox goes as after any failed build."""
    tid, bid = request_build(api, "tb-cancel")
    r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "base", "steps": [
        {"type": "RUN", "args": ["echo started; sleep 100000"]}]})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while not build_sandboxes(api) or "started" not in json.dumps(
            api.get(f"/templates/{tid}/builds/{bid}/status").json()["logEntries"]):
        assert time.monotonic() < deadline, "the build never started its step"
        time.sleep(0.2)
    sid = build_sandboxes(api)[0]
    r = api.delete(f"/templates/{tid}")
    assert r.status_code == 204, r.text
    assert build_sandboxes(api) == []
    assert host.qemu_pids(sid) == set()
    assert api.get(f"/templates/{tid}/builds/{bid}/status").status_code == 404
    assert api.post("/sandboxes", json={"templateID": "tb-cancel"}).status_code == 404


def test_a_damaged_built_template_is_rebuilt_not_republished(api: httpx.Client, node: ServerProcess) -> None:
    """A host crash can leave a built template's layers short (they were not fsynced before its
    durable manifest). An unchanged rebuild then answered "CACHED finalize" and republished the
    broken checkpoint; a build on top of it failed with "internal error: AssertionError()"."""
    body: dict[str, Any] = {"steps": [{"type": "RUN", "args": ["echo built > /home/user/b.txt"]}]}
    st, entries, _ = build(api, "tb-damaged", json.loads(json.dumps(body)))
    assert st["status"] == "ready", messages(entries)[-10:]
    repo = node.data_dir / "repository"
    manifest = next(json.loads(p.read_text()) for p in (repo / "manifests").glob("*.json")
                    if json.loads(p.read_text()).get("kind") == "template"
                    and json.loads(p.read_text()).get("name") == "tb-damaged")
    device = repo / "layers" / manifest["device"]["name"]
    device.chmod(0o644)
    device.write_bytes(b"")  # what a crash before write-back leaves
    assert api.post("/sandboxes", json={"templateID": "tb-damaged"}).status_code == 422

    tid, bid = request_build(api, "tb-on-damaged")
    r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "tb-damaged", "steps": [
        {"type": "RUN", "args": ["true"]}]})
    assert r.status_code == 202, r.text
    st, entries = wait_build(api, tid, bid)
    assert st["status"] == "error" and st["reason"]["step"] == "base", st
    assert "base template 'tb-damaged'" in st["reason"]["message"], st["reason"]

    st, entries, _ = build(api, "tb-damaged", json.loads(json.dumps(body)))  # unchanged
    assert st["status"] == "ready", messages(entries)[-10:]
    assert not any(m.startswith("CACHED finalize") for m in messages(entries)), messages(entries)
    sid = api.post("/sandboxes", json={"templateID": "tb-damaged"}).json()["sandboxID"]
    try:
        assert run(api, sid, "cat /home/user/b.txt")["stdout"] == "built\n"
    finally:
        api.delete(f"/sandboxes/{sid}")

    # force (the SDK's skip_cache) builds again even with no steps at all
    st, entries, _ = build(api, "tb-nosteps", {"steps": []})
    assert st["status"] == "ready", messages(entries)[-10:]
    st, entries, _ = build(api, "tb-nosteps", {"steps": [], "force": True})
    assert st["status"] == "ready", messages(entries)[-10:]
    assert not any(m.startswith("CACHED finalize") for m in messages(entries)), messages(entries)


def test_deleting_a_template_keeps_its_running_sandboxes(api: httpx.Client) -> None:
    st, entries, _ = build(api, "tb-del", {"steps": [{"type": "RUN", "args": ["echo keep > /home/user/d.txt"]}]})
    assert st["status"] == "ready", messages(entries)[-10:]
    sid = api.post("/sandboxes", json={"templateID": "tb-del"}).json()["sandboxID"]
    try:
        assert api.delete("/templates/tb-del").status_code == 204
        assert api.get("/templates/tb-del").status_code == 404
        assert api.post("/sandboxes", json={"templateID": "tb-del"}).status_code == 404
        assert api.delete("/templates/tb-del").status_code == 404
        out = run(api, sid, "sync; echo 3 > /proc/sys/vm/drop_caches; cat /home/user/d.txt", user="root")
        assert out["stdout"] == "keep\n"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_build_status_survives_a_restart_and_a_build_cut_short_becomes_an_error(
        api: httpx.Client, node: ServerProcess) -> None:
    st, _, _ = build(api, "tb-keep", {"steps": [{"type": "RUN", "args": ["echo kept"]}]})
    assert st["status"] == "ready"
    tid, bid = request_build(api, "tb-cut")
    r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "base", "steps": [
        {"type": "RUN", "args": ["echo started-long-step; sleep 120"]}]})
    assert r.status_code == 202
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        logs = api.get(f"/templates/{tid}/builds/{bid}/status").json()["logEntries"]
        if any("started-long-step" == e["message"] for e in logs):
            break
        time.sleep(0.3)
    else:
        raise AssertionError("the long step did not start")
    # An upload of the build's files in progress too: its temp file is all that is left of it.
    uploads = node.data_dir / "build-files"
    url = api.get(f"/templates/{tid}/files/cut0upload0123").json()["url"]

    def slow_body() -> Iterator[bytes]:
        yield b"x" * 65536
        time.sleep(30)  # the server is killed meanwhile
        yield b"y"

    threading.Thread(target=_put_quietly, args=(url, slow_body()), daemon=True).start()
    deadline = time.monotonic() + 30
    while not any(uploads.glob(".*.part")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(uploads.glob(".*.part")), "the upload never started"
    node.stop(signal.SIGKILL)
    node.start()
    assert list(uploads.glob(".*.part")) == [], "an interrupted upload is removed at start"
    with node.client() as c:
        assert c.get(f"/templates/{tid}/files/cut0upload0123").json()["present"] is False
        again = c.get(f"/templates/tb-keep/builds/{st['buildID']}/status").json()
        assert again["status"] == "ready" and any("kept" == e["message"] for e in again["logEntries"])
        cut = c.get(f"/templates/{tid}/builds/{bid}/status").json()
        assert cut["status"] == "error" and cut["reason"]["message"] == "server restarted during the build"
        assert build_sandboxes(c) == []
        sid = c.post("/sandboxes", json={"templateID": "tb-keep"}).json()["sandboxID"]
        c.delete(f"/sandboxes/{sid}")


def _put_quietly(url: str, body: Iterator[bytes]) -> None:
    try:
        httpx.put(url, content=body, timeout=60)
    except httpx.HTTPError:
        pass  # the server was killed under it


def test_upload_url_needs_its_token(api: httpx.Client, node: ServerProcess) -> None:
    tid, _ = request_build(api, "tb-up")
    url = api.get(f"/templates/{tid}/files/abcdef0123456789").json()["url"]
    assert httpx.put(url.split("?")[0], content=b"x").status_code in (401, 403)
    assert Path(node.data_dir / "build-files").exists()


def test_stored_files_are_kept_as_first_uploaded(api: httpx.Client, node: ServerProcess) -> None:
    """Files are stored by hash and shared by every build with that hash; the upload url never
    expires, so a second PUT must not swap what those builds copy. It succeeds all the same:
    two builds sharing a COPY step both upload, and the SDKs fail a build on an error here."""
    tid, _ = request_build(api, "tb-up2")
    h = "0123456789abcdef" * 4
    url = api.get(f"/templates/{tid}/files/{h}").json()["url"]
    first, second = tar_gz({"a.txt": b"first"}), tar_gz({"a.txt": b"second"})
    assert httpx.put(url, content=first).status_code == 204
    r = httpx.put(url, content=second)
    assert r.status_code == 204, r.text
    assert (node.data_dir / "build-files" / h).read_bytes() == first
    assert api.get(f"/templates/{tid}/files/{h}").json()["present"] is True


def test_cli_template_build_ls_start_and_rm(node: ServerProcess, api: httpx.Client, tmp_path: Path) -> None:
    from tests.e2e.test_cli_e2e import aenv

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "hello.txt").write_text("from the context\n")
    (tmp_path / "aenv.Dockerfile").write_text(
        "FROM base\nENV WHO=cli\nCOPY data /home/user/data\nRUN cat data/hello.txt > copy.txt && \\\n"
        "    echo $WHO >> copy.txt\nSTART_CMD sleep 100000\n")
    r = aenv(node, "template", "build", str(tmp_path), "--name", "tb-cli")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[3/3] RUN" in r.stdout and "template 'tb-cli' built" in r.stderr
    r = aenv(node, "template", "build", str(tmp_path), "--name", "tb-cli")
    assert r.returncode == 0 and r.stdout.count("CACHED [") == 3 and "CACHED finalize" in r.stdout, r.stdout
    assert "tb-cli" in [t["templateID"] for t in json.loads(aenv(node, "template", "ls", "-o", "json").stdout)]
    sid = aenv(node, "start", "-d", "tb-cli").stdout.strip()
    try:
        assert run(api, sid, "cat copy.txt")["stdout"] == "from the context\ncli\n"
    finally:
        api.delete(f"/sandboxes/{sid}")
    (tmp_path / "bad.Dockerfile").write_text("FROM base\nRUN echo no-such-luck; false\n")
    r = aenv(node, "template", "build", str(tmp_path), "-f", str(tmp_path / "bad.Dockerfile"), "--name", "tb-cli2")
    assert r.returncode == 1 and "step 1" in r.stderr and "no-such-luck" in r.stderr, r.stderr
    assert aenv(node, "template", "rm", "tb-cli").returncode == 0
    assert aenv(node, "template", "rm", "tb-cli").returncode == 1


def test_a_template_is_not_started_from_before_its_build_has_published_it(tmp_path: Path) -> None:
    """The build's snapshot is written, then made durable under the template's name with its
    final configuration (seconds for large layers). In between, a create by that name must not
    start from the half-made checkpoint: it carries the build sandbox's marker, for which the
    next server start kills a sandbox. A node of its own stops the build in between."""
    s = ServerProcess(tmp_path / "data", node_cidr(50), AENV_POOL_SIZE="0", AENV_FAULTS="template_after_publish")
    s.start()
    try:
        with s.client() as api:
            tid, bid = request_build(api, "halfway")
            r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromTemplate": "base", "steps": [
                {"type": "RUN", "args": ["echo built > /home/user/built.txt"]}]})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + 300
            while "crash point template_after_publish reached" not in s.log.read_text(errors="replace"):
                assert time.monotonic() < deadline, "the build never reached its snapshot"
                time.sleep(0.2)
            r = api.post("/sandboxes", json={"templateID": "halfway"})
            assert r.status_code == 404, r.text
            assert not [x for x in api.get("/sandboxes").json() if x["templateID"] == "halfway"]
    finally:
        if s.proc is not None:  # stopped at its crash point: a graceful stop would wait on it
            s.stop(signal.SIGKILL)
        s.kill_all()
