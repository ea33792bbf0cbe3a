"""Where the CLI finds the server and its API key.

Resolution, per value: ``--url``/``--key`` (or ``AENV_URL``/``AENV_API_KEY``), then
``~/.config/agentenv/credentials.json`` (written by `aenv auth`), then the local defaults:
http://127.0.0.1:8000 and the key file the server generates in its data dir. A key is only
sent to the server it belongs to (``resolve``). The file holds a
secret, so it is written 0600 in a 0700 directory, atomically.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agentenv.cli.context import CliError
from agentenv.config import Settings

_DEFAULTS = Settings()
DEFAULT_URL = f"http://{_DEFAULTS.host}:{_DEFAULTS.port}"  # http://127.0.0.1:8000
DEFAULT_DATA_DIR = _DEFAULTS.data_dir  # /var/lib/agentenv


@dataclass(frozen=True)
class Credentials:
    url: str
    key: str | None


def credentials_path() -> Path:
    return Path.home() / ".config" / "agentenv" / "credentials.json"


def data_dir() -> Path:
    return Path(os.environ.get("AENV_DATA_DIR") or DEFAULT_DATA_DIR)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def read_key_file(directory: Path | None = None) -> str | None:
    """The server's generated key (``<data-dir>/api_key``) if this user may read it."""
    try:
        key = ((directory or data_dir()) / "api_key").read_text().strip()
    except OSError:
        return None
    return key or None


def load() -> dict[str, str]:
    """The saved credentials ({} when `aenv auth` never ran)."""
    path = credentials_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path} ({exc}); run `aenv auth` again") from exc
    if not isinstance(data, dict):
        raise CliError(f"{path} is not a JSON object; run `aenv auth` again")
    return {k: v for k, v in data.items() if isinstance(v, str)}


def save(url: str, key: str) -> Path:
    """Write the credentials file 0600 (directory 0700), replacing any previous one atomically."""
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "key": key}, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o600)  # O_CREAT's mode is filtered by the umask and ignored if tmp existed
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def is_local(url: str) -> bool:
    """Whether ``url`` names a server on this host (whose data dir's key file is its key)."""
    try:
        host = urlsplit(normalize_url(url)).hostname or ""
    except ValueError:  # not a URL at all: the client says so when it is used
        return False
    return host in ("localhost", "::1") or host.startswith("127.")


def resolve(url: str | None = None, key: str | None = None) -> Credentials:
    """Flags/env first, then the credentials file, then the local defaults. A key goes only
    to the server it belongs to: the saved key to the saved URL, the data dir's key file to a
    server on this host. Another server named with ``--url`` gets no key (its 401 then says
    to run `aenv auth`), rather than this one's."""
    saved = load() if not (url and key) else {}
    target = normalize_url(url or saved.get("url") or DEFAULT_URL)
    if key is None and saved.get("key") and normalize_url(saved.get("url") or DEFAULT_URL) == target:
        key = saved["key"]
    if key is None and is_local(target):
        key = read_key_file()
    return Credentials(url=target, key=key)
