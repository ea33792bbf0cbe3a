"""Starting a user process: the tools drive's ``libaenvspawn.so`` (guest/spawn.c) through ctypes.

One call is one vfork-style clone whose child enters PID 1's mount namespace, the working
directory, the user and the terminal, then execs the command: a single exec per command. See
spawn.c for why this is not ``os.posix_spawn`` of a helper program nor a ``preexec_fn``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Mapping, Sequence

LIBRARY = "libaenvspawn.so"


class _Request(ctypes.Structure):
    """``struct aenv_spawn_req`` of spawn.c; keep the two in step."""
    _fields_ = [
        ("file", ctypes.c_char_p),
        ("argv", ctypes.POINTER(ctypes.c_char_p)),
        ("envp", ctypes.POINTER(ctypes.c_char_p)),
        ("path", ctypes.c_char_p),
        ("cwd", ctypes.c_char_p),
        ("ns_fd", ctypes.c_int),
        ("fds", ctypes.c_int * 3),
        ("ctty", ctypes.c_int),
        ("preopen", ctypes.c_int),
        ("switch_user", ctypes.c_int),
        ("uid", ctypes.c_uint),
        ("gid", ctypes.c_uint),
        ("ngroups", ctypes.c_int),
        ("groups", ctypes.POINTER(ctypes.c_uint)),
        ("err", ctypes.c_int),
        ("what", ctypes.c_char_p),
    ]


class SpawnFailed(OSError):
    """The child could not exec the command (no such program, permission denied, a working
    directory it cannot enter): ``step`` says which step failed."""

    def __init__(self, errno: int, step: str) -> None:
        super().__init__(errno, os.strerror(errno))
        self.step = step


def _strings(items: Sequence[bytes]) -> ctypes.Array:
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


class Spawner:
    """The loaded library plus the namespace descriptor every command enters (opened once)."""

    def __init__(self, library: str, user_namespace: str | None) -> None:
        self._fn = ctypes.CDLL(library).aenv_spawn
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(_Request)]
        self._ns_fd = os.open(user_namespace, os.O_RDONLY | os.O_CLOEXEC) if user_namespace else -1

    def spawn(self, cmd: str, args: Sequence[str], env: Mapping[str, str], *, cwd: str,
              stdio: tuple[int, int, int], user: tuple[int, int, Sequence[int]] | None = None,
              ctty: bool = False, preopen: bool = False) -> int:
        """Start ``cmd`` with ``args`` (argv[0] is ``cmd``) and exactly ``env``; the child's pid.
        ``user``: (uid, gid, groups) to switch to. Raises SpawnFailed when the child could not
        exec the command, OSError when no process could be made."""
        argv = _strings([os.fsencode(a) for a in (cmd, *args)])
        envp = _strings([os.fsencode(f"{k}={v}") for k, v in env.items()])
        req = _Request(file=os.fsencode(cmd), argv=argv, envp=envp, path=os.fsencode(env.get("PATH", "")),
                       cwd=os.fsencode(cwd), ns_fd=self._ns_fd, ctty=int(ctty), preopen=int(preopen))
        req.fds[:] = stdio
        if user is not None:
            uid, gid, groups = user
            req.switch_user, req.uid, req.gid, req.ngroups = 1, uid, gid, len(groups)
            req.groups = (ctypes.c_uint * max(1, len(groups)))(*groups)
        pid = self._fn(ctypes.byref(req))
        if pid < 0 and req.what:
            raise SpawnFailed(-pid, req.what.decode())
        if pid < 0:
            raise OSError(-pid, os.strerror(-pid))
        return pid
