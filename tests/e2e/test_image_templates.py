"""Templates from OCI images, end to end: images built by the tests, pushed with skopeo to a real
docker-registry on loopback (one open, one behind htpasswd), pulled by the server, booted as
real microVMs with the agent running from the tools drive."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import run
from tests.framework.net import node_cidr
from tests.framework.registry import (
    BlackHole,
    BuiltImage,
    LocalRegistry,
    build_busybox_image,
    build_debian_image,
    build_image_from_tars,
)
from tests.framework.server import ServerProcess

AUTH = ("aenv", "s3cret-pass")


@pytest.fixture(scope="module")
def registries() -> Iterator[tuple[LocalRegistry, LocalRegistry]]:
    with LocalRegistry() as open_, LocalRegistry(auth=AUTH) as private:
        yield open_, private


@pytest.fixture(scope="module")
def images(registries: tuple[LocalRegistry, LocalRegistry]) -> dict[str, BuiltImage]:
    open_, private = registries
    return {"busybox": build_busybox_image(open_, "tiny/busybox"), "debian": build_debian_image(open_, "debian"),
            "private": build_busybox_image(private, "team/secret"),
            "distroless": build_busybox_image(open_, "distroless/app", shell=False),
            "short-lived": build_busybox_image(open_, "short/lived", tag="2")}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, registries: tuple[LocalRegistry, LocalRegistry]) -> Iterator[ServerProcess]:
    insecure = ",".join(r.host for r in registries)
    s = ServerProcess(tmp_path_factory.mktemp("images") / "data", node_cidr(26), AENV_POOL_SIZE="0",
                      AENV_INSECURE_REGISTRIES=insecure, AENV_REGISTRY_TIMEOUT="60")
    s.start()
    yield s
    s.kill_all()


@pytest.fixture(scope="module")
def api(node: ServerProcess) -> Iterator[httpx.Client]:
    with node.client(timeout=600) as c:
        yield c


def _sandbox(api: httpx.Client, template: str) -> str:
    r = api.post("/sandboxes", json={"templateID": template, "timeout": 600})
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


def test_busybox_only_image_becomes_a_template_that_runs_commands(api: httpx.Client, images) -> None:
    ref = images["busybox"].ref
    r = api.post("/images/pull", json={"image": ref, "name": "bb"})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["templateID"] == "bb" and info["image"]["digest"] == images["busybox"].digest
    assert info["image"]["config"]["env"]["AENV_TEST"] == "busybox"
    assert "bb" in [t["templateID"] for t in api.get("/templates").json()]
    sid = _sandbox(api, "bb")
    try:
        # The image has no bash, no libc, no Python: `bash -l -c` runs in its /bin/sh, as the
        # user the conversion added, in the image's WorkingDir, with the image's Env.
        out = run(api, sid, "echo $AENV_TEST; pwd; id -u; readlink /bin/sh")
        assert out["exitCode"] == 0, out
        assert out["stdout"].split() == ["busybox", "/work", "1000", "busybox"]
        assert run(api, sid, "whoami", user="root")["stdout"].strip() == "root"
        # The tools drive the agent runs from is not in the user's view, not even for root.
        seen = run(api, sid, "ls -A /run/agentenv; grep -c agentenv /proc/self/mountinfo", user="root")
        assert seen["stdout"].split() == ["0"], seen
        # files through the agent, into the image's own file system
        assert api.put(f"/sandboxes/{sid}/files", params={"path": "/work/note.txt"}, content=b"hello").status_code < 300
        assert run(api, sid, "cat /work/note.txt")["stdout"] == "hello"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_image_with_no_shell_at_all_still_runs_commands(api: httpx.Client, images) -> None:
    """distroless: no /bin, no sh. SDK-style `bash -l -c` requests run in the tools drive's
    busybox sh (exec'd by descriptor into the user's view, which still has no tools drive)."""
    assert api.post("/images/pull", json={"image": images["distroless"].ref, "name": "nosh"}).status_code == 201
    sid = _sandbox(api, "nosh")
    try:
        out = run(api, sid, "echo $((6*7)) $AENV_TEST; [ -e /bin ] || echo no-bin; busybox id -u")
        assert out["exitCode"] == 0, out
        assert out["stdout"].split() == ["42", "distroless", "no-bin", "1000"], out
        assert run(api, sid, ["/app/busybox", "echo", "direct"])["stdout"] == "direct\n"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_debian_image_template_has_its_python_and_defaults(api: httpx.Client, images) -> None:
    r = api.post("/images/pull", json={"image": images["debian"].ref, "name": "deb"})
    assert r.status_code == 201, r.text
    sid = _sandbox(api, "deb")
    try:
        out = run(api, sid, "python3 -c 'import sys; print(sys.prefix)'; echo $AENV_TEST; pwd; whoami")
        assert out["stdout"].split() == ["/usr", "debian", "/home/user", "user"], out
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_pull_under_a_name_already_taken_updates_the_template(api: httpx.Client, images) -> None:
    """Before, creates went on starting from the first image's template snapshot (cached by
    name and shape) for as long as its memory file existed."""
    assert api.post("/images/pull", json={"image": images["busybox"].ref, "name": "moving"}).status_code == 201
    sid = _sandbox(api, "moving")
    try:
        assert run(api, sid, "echo $AENV_TEST")["stdout"] == "busybox\n"
    finally:
        api.delete(f"/sandboxes/{sid}")
    r = api.post("/images/pull", json={"image": images["debian"].ref, "name": "moving"})
    assert r.status_code == 201 and r.json()["image"]["digest"] == images["debian"].digest, r.text
    sid = _sandbox(api, "moving")
    try:
        out = run(api, sid, "echo $AENV_TEST; python3 -c 'print(1)'")
        assert out["stdout"].split() == ["debian", "1"], out
    finally:
        api.delete(f"/sandboxes/{sid}")
    assert api.delete("/templates/moving").status_code == 204


def test_private_registry_needs_the_right_credentials(api: httpx.Client, images, registries) -> None:
    ref, host = images["private"].ref, registries[1].host
    r = api.post("/images/pull", json={"image": ref, "name": "secret"})
    assert r.status_code == 401 and host in r.json()["message"], r.text
    r = api.post("/images/pull", json={"image": ref, "name": "secret", "username": AUTH[0], "password": "wrong"})
    assert r.status_code == 401 and host in r.json()["message"], r.text
    assert "wrong" not in r.text  # the password never comes back
    r = api.post("/images/pull", json={"image": ref, "name": "secret", "username": AUTH[0], "password": AUTH[1]})
    assert r.status_code == 201, r.text
    assert AUTH[1] not in r.text


def test_missing_image_and_bad_input_get_clear_errors(api: httpx.Client, registries) -> None:
    host = registries[0].host
    r = api.post("/images/pull", json={"image": f"{host}/nope/none:1"})
    assert r.status_code == 404 and f"{host}/nope/none:1" in r.json()["message"], r.text
    r = api.post("/images/pull", json={"image": "UPPER CASE!"})
    assert r.status_code == 400, r.text
    r = api.post("/images/pull", json={"image": f"{host}/tiny/busybox:1", "name": "base"})
    assert r.status_code == 400 and "reserved" in r.json()["message"], r.text
    r = api.post("/images/pull", json={"image": f"{host}/tiny/busybox:1", "diskSizeMB": 10})
    assert r.status_code == 400 and "diskSizeMB" in r.json()["message"], r.text


def test_cli_pull_then_start(node: ServerProcess, images) -> None:
    env = {**os.environ, "AENV_URL": node.url, "AENV_API_KEY": node.api_key}
    aenv = [sys.executable, "-m", "agentenv.cli.main"]
    out = subprocess.run([*aenv, "pull", images["busybox"].ref, "--name", "bb-cli"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "bb-cli\n" and "start it with" in out.stderr  # T=$(aenv pull ...) is the id
    out = subprocess.run([*aenv, "start", "bb-cli", "-d"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    sid = out.stdout.strip()
    out = subprocess.run([*aenv, "exec", sid, "--", "cat", "/etc/passwd"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "user:x:1000" in out.stdout, out.stderr
    subprocess.run([*aenv, "rm", sid], env=env, capture_output=True, timeout=120)


def test_build_steps_on_an_image_without_bash(api: httpx.Client, images) -> None:
    """fromImage: the build pulls the image, runs its steps in the image's /bin/sh, snapshots.
    The build is named like its image (``busybox`` from ``tiny/busybox``): the image it
    starts from must not take that name, or creates would start from the bare image and a
    rebuild be refused."""
    from tests.e2e.test_template_build import request_build, wait_build

    for stage in ("two", "three"):  # a build, then a rebuild under the same name
        tid, bid = request_build(api, "busybox")
        r = api.post(f"/v2/templates/{tid}/builds/{bid}", json={"fromImage": images["busybox"].ref, "steps": [
            {"type": "RUN", "args": ["echo built-in-image > /work/built.txt", "root"]},
            {"type": "ENV", "args": ["STAGE", stage]},
        ]})
        assert r.status_code == 202, r.text
        st, entries = wait_build(api, tid, bid)
        assert st["status"] == "ready", entries[-5:]
        sid = _sandbox(api, "busybox")
        try:
            out = run(api, sid, "cat /work/built.txt; echo $STAGE $AENV_TEST")
            assert out["stdout"].split() == ["built-in-image", stage, "busybox"], out
        finally:
            api.delete(f"/sandboxes/{sid}")
    assert api.delete("/templates/busybox").status_code == 204


def _age(paths: list[Path]) -> None:
    """Make files look older than the 10 minutes a pull in progress is protected for."""
    for p in paths:
        os.utime(p, (1_000_000_000, 1_000_000_000))


def test_a_refused_pulls_download_is_freed_by_a_later_pull(api: httpx.Client, registries, images,
                                                           node: ServerProcess, tmp_path: Path) -> None:
    """A pull whose conversion is refused (too large for its disk) keeps its download for a
    while (a retry with a larger disk reuses it); later pulls free it once it is unused and
    older than a pull in progress could be. Before, only a template's deletion did."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(8 << 30)  # sparse: a tiny layer that claims 8 GiB
    tar = tmp_path / "big.tar"
    subprocess.run(["tar", "--sparse", "-C", str(tmp_path), "-cf", str(tar), "big"], check=True)
    built = build_image_from_tars(registries[0], "too/big", [tar])
    r = api.post("/images/pull", json={"image": built.ref, "name": "too-big", "diskSizeMB": 512})
    assert r.status_code in (400, 413, 422, 507), r.text
    layout = node.data_dir / "images" / "oci" / built.digest.removeprefix("sha256:")
    assert layout.is_dir()
    _age([layout])
    assert api.post("/images/pull", json={"image": images["busybox"].ref, "name": "bb-after"}).status_code == 201
    assert not layout.exists()
    assert api.delete("/templates/bb-after").status_code == 204


def test_delete_image_template_keeps_running_sandboxes_then_frees_the_image(api: httpx.Client, images,
                                                                            node: ServerProcess) -> None:
    digest = images["short-lived"].digest.removeprefix("sha256:")
    assert api.post("/images/pull", json={"image": images["short-lived"].ref, "name": "bb-del"}).status_code == 201
    store = node.data_dir / "images"
    ext4 = [p for p in (store / "rootfs").glob(f"oci-{digest}-*.ext4")]
    assert len(ext4) == 1 and (store / "oci" / digest).is_dir()
    sid = _sandbox(api, "bb-del")
    try:
        _age([ext4[0], store / "oci" / digest])
        assert api.delete("/templates/bb-del").status_code == 204
        assert "bb-del" not in [t["templateID"] for t in api.get("/templates").json()]
        assert api.post("/sandboxes", json={"templateID": "bb-del"}).status_code == 404
        assert run(api, sid, "echo still")["stdout"] == "still\n"
        assert ext4[0].exists()  # the running sandbox's disk chain ends in it
    finally:
        api.delete(f"/sandboxes/{sid}")
    # The next deletion frees what nothing uses any more: the template snapshot, the image.
    assert api.post("/images/pull", json={"image": images["busybox"].ref, "name": "bb-tmp"}).status_code == 201
    assert api.delete("/templates/bb-tmp").status_code == 204
    assert not ext4[0].exists() and not (store / "oci" / digest).exists()
    assert not list((node.data_dir / "templates").glob("bb-del/snapshots/*/meta.json"))
    assert api.delete("/templates/base").status_code == 400


def test_no_image_is_cleaned_up_while_a_pull_is_in_progress(api: httpx.Client, registries, node: ServerProcess,
                                                           tmp_path: Path) -> None:
    """A pull uses the layout it downloads or reuses before any template does: a clean-up
    meanwhile (a template's deletion, another pull's start) took an unused layout older than
    10 minutes from under it. Clean-ups now wait while a pull runs (here one that hangs on a
    registry that never answers) and run when the last one ends."""
    (tmp_path / "gate.txt").write_text(f"{time.time_ns()}\n")  # an image of its own digest
    tar = tmp_path / "gate.tar"
    subprocess.run(["tar", "-C", str(tmp_path), "-cf", str(tar), "gate.txt"], check=True)
    built = build_image_from_tars(registries[0], "gate/image", [tar])
    assert api.post("/images/pull", json={"image": built.ref, "name": "gate"}).status_code == 201
    layout = node.data_dir / "images" / "oci" / built.digest.removeprefix("sha256:")
    with BlackHole() as hole, ThreadPoolExecutor(1) as ex:
        hanging = ex.submit(lambda: node.client().post("/images/pull", json={"image": f"{hole.host}/x:1"},
                                                       timeout=120))
        time.sleep(1.0)  # that pull is in progress
        _age([layout])  # as a layout reused by a pull would look
        assert api.delete("/templates/gate").status_code == 204
        assert layout.is_dir(), "cleaned up while a pull was in progress"
    assert hanging.result(120).status_code >= 400  # (the hole closed)
    assert not layout.exists(), "the clean-up asked for meanwhile runs once the last pull has ended"
