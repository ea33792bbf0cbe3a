"""Make an unpacked OCI root filesystem bootable by our guest, without running any of its code.

Container images assume a runtime that mounts /proc, /dev, … and bind-mounts /etc/hosts and
/etc/resolv.conf; our guest boots the tree as a disk instead, so the mount points must exist
and those two files must be regular files (the guest's init writes resolv.conf). Sandboxes run
commands as ``user`` (E2B's convention), so that account is added when the image lacks it.

The tree comes from an untrusted image: every path is resolved *inside* the tree
(``resolve_in``, chroot-style), so a symlink such as ``etc -> /etc`` can never make us edit the
host's files. Editing passwd/group/shadow by hand (not ``useradd``) keeps the image's binaries,
built for who knows what, from ever running on the host.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from agentenv.errors import InvalidRequest

USER = "user"
FIRST_UID = 1000
MOUNT_POINTS = (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("run", 0o755),
                ("home", 0o755))
DEFAULT_HOSTS = b"127.0.0.1 localhost\n127.0.1.1 sandbox\n::1 localhost ip6-localhost ip6-loopback\n"


def resolve_in(root: Path, rel: str, *, max_links: int = 40) -> Path:
    """``rel`` resolved as if ``root`` were ``/``: absolute link targets restart at ``root`` and
    ``..`` stops there. The result has no symlink in it (its last part may not exist)."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    done: list[str] = []
    links = 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            if done:
                done.pop()
            continue
        cur = root.joinpath(*done, name)
        if cur.is_symlink():
            links += 1
            if links > max_links:
                raise InvalidRequest(f"image path /{rel} has a symlink loop")
            target = os.readlink(cur)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        done.append(name)
    return root.joinpath(*done)


def _ensure_dir(root: Path, rel: str, mode: int) -> Path:
    p = resolve_in(root, rel)
    if not p.exists():
        p.mkdir(parents=True)
        os.chmod(p, mode)
    elif not p.is_dir():
        raise InvalidRequest(f"the image's /{rel} is not a directory; the guest needs it as one")
    return p


def _ensure_regular(root: Path, rel: str, default: bytes) -> None:
    """Replace a symlink (e.g. resolv.conf -> /run/systemd/…) or a missing file with a regular
    file, keeping the content the link pointed at when that is a regular file inside the tree
    of at most ``MAX_TABLE_BYTES`` (the image chose it: a link to a file of GiBs must not be
    read into the server's memory)."""
    lexical = root / rel
    if lexical.is_symlink():
        try:
            text = _read_regular(resolve_in(root, rel))
        except InvalidRequest:
            text = None
        data = default if text is None else text.encode()
        lexical.unlink()
        lexical.write_bytes(data)
        os.chmod(lexical, 0o644)
    elif not lexical.exists():
        lexical.write_bytes(default)
        os.chmod(lexical, 0o644)
    elif not lexical.is_file():
        raise InvalidRequest(f"the image's /{rel} is not a regular file")


MAX_TABLE_BYTES = 16 << 20  # an account table larger than this is no account table


def _read_regular(path: Path) -> str | None:
    """The text of an account table of the image, or None when there is none. Anything but a
    regular file of sane size is refused: the image chose what is at that path, and reading a
    FIFO would block forever, a device such as /dev/zero would never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidRequest(f"the image's {path.name} cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_TABLE_BYTES:
            raise InvalidRequest(f"the image's /etc/{path.name} is not a regular file of at most "
                                 f"{MAX_TABLE_BYTES >> 20} MiB")
        return f.read(MAX_TABLE_BYTES).decode(errors="replace")


def _read_table(path: Path) -> list[list[str]]:
    text = _read_regular(path)
    if text is None:
        return []
    return [ln.split(":") for ln in text.splitlines() if ln and not ln.startswith("#")]


def _append(path: Path, line: str, *, create_with: str | None, mode: int = 0o644) -> None:
    """Append one line; create the file (with ``create_with`` first) only when that is given."""
    text = _read_regular(path)
    if text is None:
        if create_with is None:
            return
        path.write_text(create_with)
        os.chmod(path, mode)
        text = create_with
    with open(path, "a") as f:  # a regular file (above), and no symlink (resolve_in)
        f.write(("" if not text or text.endswith("\n") else "\n") + line + "\n")


def _free_id(taken: set[int]) -> int:
    n = FIRST_UID
    while n in taken:
        n += 1
    return n


def add_user(root: Path) -> int | None:
    """Add ``user`` (uid = gid, 1000 or the next id free in both passwd and group) with its home
    /home/user owned by it. Returns the uid, or None if the image already has ``user``."""
    _ensure_dir(root, "etc", 0o755)
    passwd, group = resolve_in(root, "etc/passwd"), resolve_in(root, "etc/group")
    users = _read_table(passwd)
    if any(row[0] == USER for row in users):
        return None
    taken = {int(r[2]) for r in users if len(r) > 2 and r[2].isdigit()}
    taken |= {int(r[2]) for r in _read_table(group) if len(r) > 2 and r[2].isdigit()}
    uid = _free_id(taken)
    shell = "/bin/bash" if resolve_in(root, "bin/bash").is_file() else "/bin/sh"
    _append(passwd, f"{USER}:x:{uid}:{uid}::/home/{USER}:{shell}", create_with="root:x:0:0:root:/root:/bin/sh\n")
    _append(group, f"{USER}:x:{uid}:", create_with="root:x:0:\n")
    days = int(time.time() // 86400)
    _append(resolve_in(root, "etc/shadow"), f"{USER}:*:{days}:0:99999:7:::", create_with=None)
    _append(resolve_in(root, "etc/gshadow"), f"{USER}:!::", create_with=None)
    home = _ensure_dir(root, f"home/{USER}", 0o750)
    os.chown(home, uid, uid)
    return uid


def prepare_tree(root: Path, *, with_user: bool = True, workdir: str | None = None) -> None:
    """Everything the guest needs from a tree: mount points, regular hosts/resolv.conf, ``user``,
    and the image's working directory (container runtimes create it when it is missing)."""
    for rel, mode in MOUNT_POINTS:
        _ensure_dir(root, rel, mode)
    etc = _ensure_dir(root, "etc", 0o755)
    rel_etc = etc.relative_to(root).as_posix()
    _ensure_regular(root, f"{rel_etc}/hosts", DEFAULT_HOSTS)
    _ensure_regular(root, f"{rel_etc}/resolv.conf", b"")
    if with_user:
        add_user(root)
    if workdir and workdir.startswith("/"):
        _ensure_dir(root, workdir, 0o755)
