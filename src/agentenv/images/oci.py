"""Any OCI image → a local OCI layout keyed by manifest digest → a read-only ext4 root filesystem.

skopeo does the registry work (auth, mirrors' HTTP, digest checks while copying), umoci the
layer unpacking (whiteouts, ownership), mkfs.ext4 -d the disk; this module only decides what
to run, bounds it, and turns each failure into an error that says what to fix
(docs/mechanisms/images.md). The cache is ``<cache>/oci/<manifest digest hex>``: a layout is
published by one rename once complete, so a layout under that name is never partial, and it is
re-hashed before it is reused, so a damaged one is dropped rather than converted.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import json
import logging
import math
import os
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.durable import publish
from agentenv.errors import (
    AgentenvError,
    ExternalCommandError,
    ImageCorrupt,
    ImageTooLarge,
    InvalidRequest,
    ProvisioningError,
    RegistryUnreachable,
)
from agentenv.images.ocitree import prepare_tree
from agentenv.images.registry import (
    ImageRef,
    RegistrySettings,
    classify,
    parse_reference,
)
from agentenv.proc import run, run_bounded

__all__ = ["ImageConfig", "PulledImage", "pull", "to_ext4", "ext4_name", "layout_dir"]

log = logging.getLogger(__name__)

LAYOUT_TAG = "img"
META = "aenv-pull.json"  # written into a layout before it is published
CONVERT_VERSION = 1  # bump when prepare_tree changes what an ext4 holds: it is in ext4_name
HEADROOM = 1.10
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageConfig:
    """The parts of the OCI image config a sandbox uses to run like the container would."""

    env: dict[str, str]
    workdir: str | None
    user: str | None
    entrypoint: list[str]
    cmd: list[str]

    @classmethod
    def from_oci(cls, config: dict[str, Any]) -> ImageConfig:
        """Raises InvalidRequest naming the field when the image's config has the wrong types
        (the image's author chose them; they must not become a server error)."""
        c = config.get("config") or {}
        if not isinstance(c, dict):
            raise InvalidRequest("the image's config is malformed: 'config' is not an object")

        def strings(field: str) -> list[str]:
            v = c.get(field) or []
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise InvalidRequest(f"the image's config is malformed: {field} must be a list of strings")
            return v

        def string(field: str) -> str | None:
            v = c.get(field) or None
            if v is not None and not isinstance(v, str):
                raise InvalidRequest(f"the image's config is malformed: {field} must be a string")
            return v

        env = dict(e.split("=", 1) if "=" in e else (e, "") for e in strings("Env"))
        return cls(env, string("WorkingDir"), string("User"), strings("Entrypoint"), strings("Cmd"))

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "workdir": self.workdir, "user": self.user,
                "entrypoint": self.entrypoint, "cmd": self.cmd}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ImageConfig:
        return cls(dict(d.get("env") or {}), d.get("workdir"), d.get("user"),
                   list(d.get("entrypoint") or []), list(d.get("cmd") or []))


@dataclass(frozen=True)
class PulledImage:
    ref: ImageRef
    digest: str  # the manifest digest the registry serves for ref (an index's, for multi-arch)
    layout: Path  # OCI layout in the cache, its image tagged LAYOUT_TAG
    config: ImageConfig
    size_bytes: int  # sum of the compressed layer sizes


def layout_dir(cache: Path, digest: str) -> Path:
    return cache / "oci" / digest.removeprefix("sha256:")


def ext4_name(image: PulledImage, size_mb: int, *, add_user: bool = True) -> str:
    """File name for ``image`` converted at ``size_mb``: callers cache conversions under it,
    so it carries the whole digest (a 64-bit prefix could be made to collide: an image pinned
    by digest would then start from another image's conversion)."""
    hex_ = image.digest.removeprefix("sha256:")
    return f"oci-{hex_}-{size_mb}m-v{CONVERT_VERSION}{'' if add_user else '-nouser'}.ext4"


# ---------------------------------------------------------------- layout reading / verification

def _blob(layout: Path, desc: dict[str, Any], *, keep: bool) -> bytes:
    """Check one blob against its descriptor (size and sha256); return its bytes if ``keep``."""
    digest = str(desc.get("digest", ""))
    algo, _, hex_ = digest.partition(":")
    if algo != "sha256" or len(hex_) != 64:
        raise ImageCorrupt(f"layout {layout.name}: unsupported digest {digest!r}")
    path = layout / "blobs" / "sha256" / hex_
    h, size, kept = hashlib.sha256(), 0, bytearray()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
                if keep:
                    kept += chunk
    except FileNotFoundError:
        raise ImageCorrupt(f"layout {layout.name}: blob {digest} is missing") from None
    if h.hexdigest() != hex_ or ("size" in desc and size != desc["size"]):
        raise ImageCorrupt(f"layout {layout.name}: blob {digest} fails its digest (size {size})")
    return bytes(kept)


def read_layout(layout: Path, *, verify_layers: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, config) of the layout's image, both checked against their digests; every layer
    re-hashed too when ``verify_layers``. Raises ImageCorrupt. Blocking: call in a thread."""
    try:
        index = json.loads((layout / "index.json").read_text())
        descs = [d for d in index.get("manifests", [])
                 if d.get("annotations", {}).get("org.opencontainers.image.ref.name") == LAYOUT_TAG]
        manifest = json.loads(_blob(layout, descs[0], keep=True))
        config = json.loads(_blob(layout, manifest["config"], keep=True))
        layers = list(manifest["layers"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageCorrupt(f"layout {layout.name} is unreadable: {exc!r}") from None
    if verify_layers:
        for desc in layers:
            _blob(layout, desc, keep=False)
    return manifest, config


def _load(ref: ImageRef, layout: Path, digest: str, *, verify_layers: bool) -> PulledImage:
    manifest, config = read_layout(layout, verify_layers=verify_layers)
    try:
        meta = json.loads((layout / META).read_text())
    except (OSError, ValueError):
        meta = {}
    if meta.get("digest") != digest:
        raise ImageCorrupt(f"layout {layout.name} was not published for {digest}")
    size = sum(int(d.get("size", 0)) for d in manifest["layers"])
    return PulledImage(ref, digest, layout, ImageConfig.from_oci(config), size)


async def _drop(layout: Path) -> None:
    """Remove a layout: renamed away first, so it vanishes from its name in one step."""
    trash = layout.with_name(f".drop-{layout.name}-{os.getpid()}-{id(layout):x}")
    try:
        layout.rename(trash)
    except FileNotFoundError:
        return
    await asyncio.to_thread(shutil.rmtree, trash, True)


async def _reuse(ref: ImageRef, layout: Path, digest: str) -> PulledImage | None:
    if not layout.is_dir():
        return None
    try:
        pulled = await asyncio.to_thread(_load, ref, layout, digest, verify_layers=True)
    except ImageCorrupt as exc:
        log.warning("cached image %s is corrupt, pulling it again: %s", digest, exc.message)
        await _drop(layout)
        return None
    # In use again: fresh for the clean-up of unused images, which spares what a pull in
    # progress may still register (pulling.remove_unused_images).
    await asyncio.to_thread(os.utime, layout)
    return pulled


# ---------------------------------------------------------------- pulling

class _Skopeo:
    """One pull's skopeo runs against one host: TLS choice, credentials, the shared deadline."""

    def __init__(self, ref: ImageRef, host: str, settings: RegistrySettings, deadline: float,
                 creds: tuple[str, str] | None, authfile: Path | None) -> None:
        self.ref, self.host, self.settings, self.deadline, self.creds = ref, host, settings, deadline, creds
        self.authfile = authfile if creds else None

    def args(self, tls_flag: str, authfile_flag: str) -> list[str]:
        a = [f"{tls_flag}=false"] if self.host in self.settings.insecure else []
        if self.authfile:
            a += [authfile_flag, str(self.authfile)]
        return a

    async def __call__(self, args: list[str]) -> bytes:
        remaining = self.deadline - asyncio.get_running_loop().time()
        bound = self.settings.timeout_s
        if remaining <= 0:
            raise RegistryUnreachable(self.host, bound, "no time left for it in this pull")
        argv = ["skopeo", "--command-timeout", f"{remaining:.3f}s", *args]
        try:
            res = await run_bounded(argv, timeout=remaining + 2)
        except TimeoutError:
            raise RegistryUnreachable(self.host, bound, "skopeo killed at the bound") from None
        if res.returncode == 0:
            return res.stdout
        stderr, shown = res.stderr, list(argv)
        if self.creds and self.creds[1]:
            stderr = stderr.replace(self.creds[1], "***")
        raise classify(stderr, ref=self.ref, host=self.host, argv=shown, returncode=res.returncode,
                       timeout_s=bound, credentials_given=self.creds is not None)


async def _pull_from(run_: _Skopeo, root: Path) -> PulledImage:
    ref, host = run_.ref, run_.host
    raw = await run_(["inspect", "--raw", *run_.args("--tls-verify", "--authfile"), ref.on(host)])
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    if ref.digest and digest != ref.digest:
        raise ImageCorrupt(f"{host} served a manifest for {ref} whose digest is {digest}")
    layout = layout_dir(root.parent, digest)
    if cached := await _reuse(ref, layout, digest):
        return cached
    tmp = Path(tempfile.mkdtemp(prefix=f".pull-{layout.name[:12]}-", dir=root))
    try:
        pinned = ImageRef(ref.registry, ref.repository, None, digest)
        # Layers stored as zstd are recompressed to gzip on the way in (gzip ones are copied
        # as they are): umoci 0.4.7 unpacks only gzip, and the size check reads them as tar.
        await run_(["copy", "--quiet", *run_.args("--src-tls-verify", "--src-authfile"), "--dest-compress-format", "gzip",
                    pinned.on(host), f"oci:{tmp}:{LAYOUT_TAG}"])
        (tmp / META).write_text(json.dumps({"digest": digest, "reference": str(ref), "source": host}))
        try:
            tmp.rename(layout)
        except OSError:
            if not layout.is_dir():
                raise
            log.info("image %s was published by a concurrent pull", digest)  # ours is redundant
            await asyncio.to_thread(shutil.rmtree, tmp, True)
    except BaseException:
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, tmp, True))
        raise
    return await asyncio.to_thread(_load, ref, layout, digest, verify_layers=False)


async def pull(ref: str | ImageRef, cache: Path, settings: RegistrySettings, *,
               username: str | None = None, password: str | None = None) -> PulledImage:
    """Pull ``ref`` into ``<cache>/oci/<digest>`` (its mirror first, then its registry), or reuse
    the layout already there. The whole pull is bounded by ``settings.timeout_s``.

    Credentials go to skopeo in an auth file (mode 0600 in a private directory, removed after the
    pull: a command-line argument would be readable by every process of the host), never into
    an error message, and only to the reference's own registry, not to mirrors.
    """
    image_ref = ref if isinstance(ref, ImageRef) else parse_reference(ref, default_registry=settings.default_registry)
    if (username is None) != (password is None):
        raise InvalidRequest("registry credentials need both a username and a password")
    if username is not None and (not username or ":" in username):
        raise InvalidRequest("a registry username must be non-empty and contain no ':'")
    creds = (username, password) if username is not None and password is not None else None
    if ":" in str(cache.resolve()):
        raise ProvisioningError(f"image cache {cache} has a ':' in its path; skopeo and umoci read "
                                "'path:tag' and cannot use it: choose another AENV_DATA_DIR")
    root = cache / "oci"
    root.mkdir(parents=True, exist_ok=True)
    if image_ref.digest and (cached := await _reuse(image_ref, layout_dir(cache, image_ref.digest), image_ref.digest)):
        return cached  # pinned and present: no registry round trip at all
    deadline = asyncio.get_running_loop().time() + settings.timeout_s
    authdir = Path(tempfile.mkdtemp(prefix=".auth-", dir=root)) if creds else None  # mkdtemp: mode 0700
    try:
        authfile = _write_authfile(authdir, image_ref.registry, creds) if authdir and creds else None
        for host in settings.sources(image_ref):
            origin = host == image_ref.registry
            try:
                return await _pull_from(_Skopeo(image_ref, host, settings, deadline, creds if origin else None,
                                                authfile), root)
            except AgentenvError as exc:
                if origin:
                    raise
                log.warning("mirror %s failed for %s (%s); trying %s", host, image_ref, exc.message,
                            image_ref.registry)
        raise AssertionError("sources() always ends with the registry itself")
    finally:
        if authdir is not None:
            shutil.rmtree(authdir, ignore_errors=True)


def _write_authfile(directory: Path, registry: str, creds: tuple[str, str]) -> Path:
    """containers-auth.json(5) with one entry, readable only by us."""
    path = directory / "auth.json"
    token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {registry: {"auth": token}}}, f)
    return path


# ---------------------------------------------------------------- conversion

_UMOCI_CORRUPT = ("invalid tar header", "unexpected eof", "digest", "gzip", "flate", "checksum")
_MKFS_FULL = ("could not allocate", "no space left", "not enough space", "too small", "no free space")


async def _tree_mib(tree: Path) -> float:
    out = await run(["du", "-s", "-B1", "--one-file-system", str(tree)])
    return int(out.split()[0]) / (1 << 20)


BOMB_FACTOR = 2  # layers that claim more than this times the disk are refused before unpacking


# Bytes a layer's stream may hold after the end of its tar archive: the end blocks and a
# writer's padding to its record size (GNU tar: 10 KiB). More is data the unpacker may read
# as files where this reader saw the end (their tar readers disagree on some headers).
TRAILING_SLACK = 1 << 20


class _Counted:
    """A binary stream that counts the bytes read from it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.count += len(data)
        return data


def _expansion(layout: Path, manifest: dict[str, Any], max_bytes: int, max_entries: int) -> tuple[int, int]:
    """(bytes, entries) the layers unpack to at most, summed over all layers (an upper bound of
    the tree: later layers may overwrite or delete); it stops as soon as either passes its
    maximum. A layer counts as the larger of what its tar headers declare (sparse files with
    their full size, as umoci writes them) and its whole decompressed stream: umoci's Go tar
    reader and Python's disagree on some headers (a size field that starts with a NUL byte is
    0 here, not there), so the headers alone can hide a bomb. Data after what this reader sees
    as the end of the archive is refused (ImageCorrupt). Every layer is gzip or plain tar
    (the pull recompresses zstd). Blocking: call in a thread."""
    total = entries = 0
    for desc in manifest["layers"]:
        path = layout / "blobs" / "sha256" / str(desc["digest"]).partition(":")[2]
        declared = 0
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            stream = _Counted(gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw)
            try:
                ended = False
                try:
                    with tarfile.open(fileobj=stream, mode="r|") as t:  # type: ignore[call-overload]
                        for member in t:
                            entries += 1
                            declared += max(member.size, 0)
                            t.members.clear()  # tarfile keeps every member read: millions of headers are GiBs
                            if total + declared > max_bytes or entries > max_entries:
                                return total + declared, entries
                    ended = True
                except tarfile.TarError as exc:
                    # Tar writers differ (umoci's own layers end without the last padding, which
                    # Python's reader calls truncated); what is left is still counted below.
                    log.info("layer %s: headers read up to a tar error (%s)", desc["digest"], exc)
                read = stream.count
                while total + max(declared, stream.count) <= max_bytes and stream.read(1 << 20):
                    pass
            except (OSError, EOFError, zlib.error) as exc:
                raise ImageCorrupt(f"layer {desc['digest']} does not decompress: {exc}") from None
            total += max(declared, stream.count)
            if total > max_bytes:
                return total, entries
            if ended and stream.count - read > TRAILING_SLACK:
                raise ImageCorrupt(f"layer {desc['digest']} holds {stream.count - read} bytes after the end of its "
                                   f"tar archive (a header this server reads differently from the unpacker)")
    return total, entries


async def to_ext4(image: PulledImage, out: Path, *, size_mb: int, add_user: bool = True) -> Path:
    """Unpack ``image`` (in a temp dir beside its layout: trees can be big), make it bootable
    (``ocitree.prepare_tree``), pack it with ``mkfs.ext4 -d`` and publish it at ``out`` read-only.

    Raises ImageTooLarge when the tree plus 10 % does not fit ``size_mb``, ImageCorrupt when a
    layer fails its digest (checked again here: the cache may have changed since the pull).
    """
    manifest, _ = await asyncio.to_thread(read_layout, image.layout, verify_layers=True)
    # Before anything is written: layers that declare far more than the disk holds (a
    # compression or sparse-file bomb of a few KiB can claim GiBs) would fill the host's disk.
    max_bytes, max_entries = BOMB_FACTOR * size_mb << 20, BOMB_FACTOR * (size_mb << 20) // 4096
    declared, entries = await asyncio.to_thread(_expansion, image.layout, manifest, max_bytes, max_entries)
    if declared > max_bytes or entries > max_entries:
        raise ImageTooLarge(f"image {image.ref} declares {declared >> 20} MiB in {entries} files across its layers, "
                            f"far more than the {size_mb} MiB disk; ask for a larger disk")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=image.layout.parent))
    partial = out.with_name(f".{out.name}.{work.name}.partial")
    try:
        tree = work / "rootfs"
        rootless = ["--rootless"] if os.geteuid() != 0 else []
        try:  # `raw unpack`: the rootfs only, without the mtree manifest `unpack` hashes every file for
            await run(["umoci", "raw", "unpack", *rootless, "--image", f"{image.layout}:{LAYOUT_TAG}", str(tree)])
        except ExternalCommandError as exc:
            if any(m in exc.output.lower() for m in _UMOCI_CORRUPT):
                raise ImageCorrupt(f"image {image.ref} ({image.digest}) does not unpack: {exc.output.strip()[-300:]}") from None
            raise
        used = await _tree_mib(tree)
        if math.ceil(used * HEADROOM) > size_mb:
            raise ImageTooLarge(f"image {image.ref} unpacks to {used:.0f} MiB ({math.ceil(used * HEADROOM)} MiB "
                                f"with 10% headroom), more than the {size_mb} MiB disk; ask for a larger disk")
        await asyncio.to_thread(prepare_tree, tree, with_user=add_user, workdir=image.config.workdir)
        try:
            await run(["mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-O", "has_journal",
                       "-E", "lazy_itable_init=1,lazy_journal_init=1", "-d", str(tree), str(partial), f"{size_mb}M"])
        except ExternalCommandError as exc:
            if any(m in exc.output.lower() for m in _MKFS_FULL):
                raise ImageTooLarge(f"image {image.ref} ({used:.0f} MiB unpacked) does not fit an ext4 of "
                                    f"{size_mb} MiB once filesystem overhead is counted; ask for a larger disk") from None
            raise
        os.chmod(partial, 0o444)
        # A template names this file once it is here: a host crash must not leave the name on
        # an image whose blocks never reached the disk (the template would boot a torn disk).
        await asyncio.to_thread(publish, partial, out)
        return out
    finally:
        partial.unlink(missing_ok=True)
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, work, True))
