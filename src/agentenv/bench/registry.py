"""Real registries on loopback for image tests and `aenv bench`: docker-registry (distribution 2.8) processes,
a black hole (accepts TCP, never answers) and a closed port, plus image builders that push
with skopeo. No network beyond 127.0.0.1 is used.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from agentenv.bench.node import free_port  # noqa: E402  (re-exported for the tests)

REGISTRY_BIN = "/usr/bin/docker-registry"
CACHE = Path(os.environ.get("AENV_CACHE_DIR", "/var/lib/agentenv/cache"))  # as bench.node finds it


CREATED: list[Path] = []  # every temp dir this module made, so tests can assert all are gone


def _mkdtemp(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix))
    CREATED.append(d)
    return d


class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1:<free port>, storage in its own temp dir,
    optionally behind htpasswd basic auth. A context manager; ``stop`` leaves nothing behind."""

    def __init__(self, *, auth: tuple[str, str] | None = None) -> None:
        self.auth = auth
        self.dir = _mkdtemp("aenv-registry-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config(self) -> Path:
        cfg = [
            "version: 0.1", "log:", "  level: error", "  accesslog:", "    disabled: true",
            "storage:", "  filesystem:", f"    rootdirectory: {self.dir / 'data'}", "  delete:", "    enabled: true",
            "http:", f"  addr: {self.host}",
        ]
        if self.auth:
            htpasswd = subprocess.run(["htpasswd", "-Bbn", *self.auth], check=True, capture_output=True).stdout
            (self.dir / "htpasswd").write_bytes(htpasswd)
            cfg += ["auth:", "  htpasswd:", "    realm: aenv-test", f"    path: {self.dir / 'htpasswd'}"]
        path = self.dir / "config.yml"
        path.write_text("\n".join(cfg) + "\n")
        return path

    def start(self, timeout: float = 10.0) -> LocalRegistry:
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.port = free_port()
            log = (self.dir / "registry.log").open("wb")
            self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self._config())], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).close()
                    return self
                except urllib.error.HTTPError as exc:  # 401 with auth on: it answers
                    if exc.code == 401:
                        return self
                except OSError:
                    time.sleep(0.05)
            self._kill()
        raise RuntimeError(f"docker-registry did not start: {(self.dir / 'registry.log').read_text()[-1000:]}")

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def blob_path(self, digest: str) -> Path:
        hex_ = digest.removeprefix("sha256:")
        return self.dir / "data/docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BlackHole:
    """A loopback TCP port whose kernel accepts connections that nobody ever answers: a
    registry that hangs. Nothing runs; the listening socket is the whole fixture."""

    def __enter__(self) -> BlackHole:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.host = f"127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


class ClosedPort:
    """A loopback port bound but not listening (held so nobody else takes it): connection refused."""

    def __enter__(self) -> ClosedPort:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


@dataclass(frozen=True)
class BuiltImage:
    ref: str  # host:port/name:tag
    digest: str  # manifest digest as pushed
    layers: tuple[str, ...]  # layer digests, in order


def _push(registry: LocalRegistry, layout: Path, name: str, tag: str, compression: str = "gzip") -> BuiltImage:
    """Push the layout's image; ``compression="zstd"`` recompresses its layers as zstd."""
    ref = f"{registry.host}/{name}:{tag}"
    digestfile = layout.parent / "digest"
    creds = ["--dest-creds", f"{registry.auth[0]}:{registry.auth[1]}"] if registry.auth else []
    recompress = ["--dest-compress-format", compression] if compression != "gzip" else []
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds, *recompress,
                    "--digestfile", str(digestfile), f"oci:{layout}:img", f"docker://{ref}"],
                   check=True, capture_output=True)
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                          *(["--creds", ":".join(registry.auth)] if registry.auth else []), f"docker://{ref}"],
                         check=True, capture_output=True).stdout
    layers = tuple(d["digest"] for d in json.loads(raw)["layers"])
    return BuiltImage(ref, digestfile.read_text().strip(), layers)


def _configure(layout: Path, env: dict[str, str], workdir: str, cmd: list[str]) -> None:
    args = ["umoci", "config", "--image", f"{layout}:img", "--config.workingdir", workdir]
    for k, v in env.items():
        args += ["--config.env", f"{k}={v}"]
    for c in cmd:
        args += ["--config.cmd", c]
    subprocess.run(args, check=True, capture_output=True)


BUSYBOX_APPLETS = ("sh", "ls", "cat", "echo", "id", "env", "mkdir", "rm", "true")


def build_busybox_image(registry: LocalRegistry, name: str, tag: str = "1", *, shell: bool = True) -> BuiltImage:
    """An image of only a static busybox (+ applet links) and a root-only /etc/passwd. With
    ``shell=False`` a distroless-like one: the binary is /app/busybox, there is no /bin at all."""
    tmp = _mkdtemp("aenv-img-")
    try:
        layout, tree = tmp / "layout", tmp / "tree"
        (tree / "etc").mkdir(parents=True)
        if shell:
            (tree / "bin").mkdir()
            shutil.copy2("/bin/busybox", tree / "bin" / "busybox")
            for applet in BUSYBOX_APPLETS:
                (tree / "bin" / applet).symlink_to("busybox")
        else:
            (tree / "app").mkdir()
            shutil.copy2("/bin/busybox", tree / "app" / "busybox")
        (tree / "etc" / "passwd").write_text("root:x:0:0:root:/root:/sbin/nologin\n")
        (tree / "etc" / "group").write_text("root:x:0:\n")
        for argv in (["umoci", "init", "--layout", str(layout)], ["umoci", "new", "--image", f"{layout}:img"],
                     ["umoci", "insert", "--image", f"{layout}:img", str(tree), "/"]):
            subprocess.run(argv, check=True, capture_output=True)
        _configure(layout, {"PATH": "/bin" if shell else "/app", "AENV_TEST": "busybox" if shell else "distroless"},
                   "/work", ["/bin/sh", "-c", "echo hi"] if shell else ["/app/busybox"])
        return _push(registry, layout, name, tag)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_image_from_tars(registry: LocalRegistry, name: str, tars: list[Path], tag: str = "1",
                          compression: str = "gzip") -> BuiltImage:
    """An image whose layers are the given tar files as they are (tests craft hostile ones),
    compressed with ``compression`` (gzip or zstd)."""
    tmp = _mkdtemp("aenv-img-")
    try:
        layout = tmp / "layout"
        subprocess.run(["umoci", "init", "--layout", str(layout)], check=True, capture_output=True)
        subprocess.run(["umoci", "new", "--image", f"{layout}:img"], check=True, capture_output=True)
        for tar in tars:
            subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:img", str(tar)],
                           check=True, capture_output=True)
        return _push(registry, layout, name, tag, compression)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def debian_tarball(cache: Path = CACHE) -> Path:
    """The Debian tree `aenv setup` builds (images/rootfs.py), the source of a realistic image."""
    found = sorted((cache / "rootfs").glob("debian-bookworm-*.tar"), key=lambda p: p.stat().st_mtime)
    found = [p for p in found if ".partial" not in p.name]
    if not found:
        raise FileNotFoundError(f"no debian-bookworm-*.tar in {cache / 'rootfs'}: run `aenv setup` first")
    return found[-1]


def build_debian_image(registry: LocalRegistry, name: str, extra_mb: int = 0, tag: str = "1") -> BuiltImage:
    """The project's Debian tree as one layer (+ a layer of ``extra_mb`` MiB of random bytes,
    incompressible, to make images of a chosen size)."""
    tmp = _mkdtemp("aenv-img-")
    try:
        layout = tmp / "layout"
        subprocess.run(["umoci", "init", "--layout", str(layout)], check=True, capture_output=True)
        subprocess.run(["umoci", "new", "--image", f"{layout}:img"], check=True, capture_output=True)
        subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:img", str(debian_tarball())],
                       check=True, capture_output=True)
        if extra_mb:
            blob = tmp / "extra.bin"
            with blob.open("wb") as f:
                for _ in range(extra_mb):
                    f.write(os.urandom(1 << 20))
            with tarfile.open(tmp / "extra.tar", "w") as t:
                t.add(blob, arcname="opt/extra.bin")
            subprocess.run(["umoci", "raw", "add-layer", "--image", f"{layout}:img", str(tmp / "extra.tar")],
                           check=True, capture_output=True)
        _configure(layout, {"PATH": "/usr/local/bin:/usr/bin:/bin", "AENV_TEST": "debian"}, "/home/user",
                   ["/bin/bash"])
        return _push(registry, layout, name, tag)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
