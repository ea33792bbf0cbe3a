"""Image references and registry settings: what to pull, from where, and how failures read.

Kept apart from ``oci.py`` (which runs skopeo and umoci) because both the API layer (validating
a ``templateID``-like reference early) and the puller need the same parsing, with no I/O.

The grammar follows the distribution spec / docker reference rules, so that what users type
for ``docker pull`` works here: ``ubuntu`` → ``docker.io/library/ubuntu:latest``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from agentenv.errors import (
    AgentenvError,
    ExternalCommandError,
    ImageCorrupt,
    ImageNotFound,
    InvalidRequest,
    RegistryAuthFailed,
    RegistryUnreachable,
)

DOCKER_HUB = "docker.io"
_HUB_ALIASES = {"index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_HOST = re.compile(r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
                   r"|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")

VALID_FORMS = ("expected [registry[:port]/]repository[:tag][@sha256:<64 hex>], e.g. 'ubuntu', "
               "'ubuntu:22.04', 'ghcr.io/org/app:1.2', 'localhost:5000/app@sha256:…'")


@dataclass(frozen=True)
class ImageRef:
    """A fully qualified image reference: no defaults left to guess."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s

    def on(self, host: str) -> str:
        """This image's ``docker://`` address on ``host`` (the registry itself or a mirror),
        pinned to the digest when there is one, so a moving tag cannot change it under us."""
        pin = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"docker://{host}/{self.repository}{pin}"


def normalize_registry(host: str) -> str:
    h = host.lower()
    return DOCKER_HUB if h in _HUB_ALIASES else h


def parse_reference(ref: str, *, default_registry: str = DOCKER_HUB) -> ImageRef:
    """Parse and normalize a reference as ``docker pull`` would. Raises InvalidRequest."""
    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"invalid image reference {ref!r}: {why}; {VALID_FORMS}")

    if not isinstance(ref, str) or not ref or ref != ref.strip() or len(ref) > 512:
        raise bad("empty, too long or surrounded by whitespace")
    name, digest = ref, None
    if "@" in ref:
        name, digest = ref.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise bad("the digest must be sha256: followed by 64 lowercase hex digits")
    tag = None
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:  # a ':' after the last '/' starts a tag (before it, it is a port)
        name, tag = name[:colon], name[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise bad(f"tag {tag!r} must be 1-128 of letters, digits, '_', '.', '-' (not starting with '.' or '-')")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        if not _HOST.fullmatch(first):
            raise bad(f"registry host {first!r} is not a host[:port]")
        registry, repository = normalize_registry(first), rest
    else:
        registry, repository = normalize_registry(default_registry), name
    if not _REPOSITORY.fullmatch(repository):
        raise bad(f"repository {repository!r} must be lowercase path components of letters, digits and separators")
    if registry == DOCKER_HUB and "/" not in repository:
        repository = f"library/{repository}"
    if len(registry) + 1 + len(repository) > 255:
        raise bad("the name is longer than 255 characters")
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry, repository, tag, digest)


def _hosts(value: str) -> list[str]:
    return [h.strip() for h in value.split(",") if h.strip()]


@dataclass(frozen=True)
class RegistrySettings:
    """Where images come from. Mirrors are tried first and anonymously (credentials given for a
    pull are meant for the registry the reference names, never sent to a mirror)."""

    default_registry: str = DOCKER_HUB
    mirrors: Mapping[str, str] = field(default_factory=dict)  # registry -> mirror host
    insecure: frozenset[str] = frozenset()  # hosts spoken to in plain HTTP / without TLS checks
    timeout_s: float = 60.0  # one pull (manifest + all blobs), end to end

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RegistrySettings:
        """AENV_DEFAULT_REGISTRY, AENV_REGISTRY_MIRRORS="docker.io=host:port,…",
        AENV_INSECURE_REGISTRIES="host:port,…", AENV_REGISTRY_TIMEOUT (seconds)."""
        mirrors: dict[str, str] = {}
        for item in _hosts(env.get("AENV_REGISTRY_MIRRORS", "")):
            reg, sep, mirror = item.partition("=")
            if not sep or not _HOST.fullmatch(reg.strip()) or not _HOST.fullmatch(mirror.strip()):
                raise ValueError(f"AENV_REGISTRY_MIRRORS entry {item!r} must be registry=mirror-host[:port]")
            mirrors[normalize_registry(reg.strip())] = mirror.strip().lower()
        insecure = frozenset(normalize_registry(h) for h in _hosts(env.get("AENV_INSECURE_REGISTRIES", "")))
        default = normalize_registry(env.get("AENV_DEFAULT_REGISTRY", DOCKER_HUB).strip() or DOCKER_HUB)
        if not _HOST.fullmatch(default):
            raise ValueError(f"AENV_DEFAULT_REGISTRY {default!r} must be a host[:port]")
        timeout = float(env.get("AENV_REGISTRY_TIMEOUT", "60"))
        if timeout <= 0:
            raise ValueError("AENV_REGISTRY_TIMEOUT must be positive")
        return cls(default, mirrors, insecure, timeout)

    def sources(self, ref: ImageRef) -> list[str]:
        """Hosts to pull ``ref`` from, in order: its mirror (if any), then its registry."""
        mirror = self.mirrors.get(ref.registry)
        return [mirror, ref.registry] if mirror and mirror != ref.registry else [ref.registry]


# skopeo (containers/image) failure messages, most specific first. Matched case-insensitively
# against stderr; the corpus comes from the real runs in tests/images/test_oci.py.
_CORRUPT = ("digest did not match", "manifest does not match", "invalid tar header",
            "unexpected eof", "gzip: invalid header", "flate: corrupt input", "zstd", "size mismatch")
_AUTH = ("unauthorized", "authentication required", "access to the resource is denied", "invalid username/password",
         "incorrect username or password", "403 forbidden")
_NOT_FOUND = ("manifest unknown", "name unknown", "not found", "repository name not known")
_UNREACHABLE = ("connection refused", "i/o timeout", "context deadline exceeded", "no such host",
                "network is unreachable", "no route to host", "tls handshake timeout",
                "connection reset", "server misbehaving", "server gave http response to https client",
                "x509:", "certificate", "eof")


def classify(stderr: str, *, ref: ImageRef, host: str, argv: list[str], returncode: int,
             timeout_s: float, credentials_given: bool) -> AgentenvError:
    """Turn a failed skopeo run against ``host`` into the error the caller can act on."""
    low = stderr.lower()
    tail = _last_message(stderr)
    if any(m in low for m in _CORRUPT[:2]) or ("writing blob" in low and any(m in low for m in _CORRUPT)):
        return ImageCorrupt(f"image {ref} from {host} is corrupt: {tail}")
    if any(m in low for m in _AUTH):
        return RegistryAuthFailed(host, credentials_given=credentials_given, detail=tail)
    if any(m in low for m in _NOT_FOUND):
        return ImageNotFound(str(ref), f"{host} answered: {tail}")
    if any(m in low for m in _UNREACHABLE):
        hint = ""
        if "http response to https client" in low:
            hint = f"; {host} speaks plain HTTP: list it in AENV_INSECURE_REGISTRIES"
        elif "x509" in low or "certificate" in low:
            hint = f"; TLS verification of {host} failed (AENV_INSECURE_REGISTRIES skips it)"
        return RegistryUnreachable(host, timeout_s, tail + hint)
    return ExternalCommandError(argv, returncode, stderr)


def _last_message(stderr: str) -> str:
    """The human part of skopeo's last log line (``level=fatal msg="…"``), or the raw tail."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    m = re.search(r'msg="((?:[^"\\]|\\.)*)"', lines[-1])
    text = m.group(1).replace('\\"', '"') if m else lines[-1]
    return text[-500:]
