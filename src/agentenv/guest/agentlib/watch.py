"""Directory watchers for ``filesystem.Filesystem/WatchDir`` and the polling trio
``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher``.

Each watcher owns one inotify instance (``inotify_init1`` through ctypes) whose fd is registered on
the event loop, so events are read as they happen without a thread. Raw inotify records are mapped
to envd's event types the way envd's fsnotify backend maps them:

    IN_CREATE, IN_MOVED_TO   -> EVENT_TYPE_CREATE       IN_MODIFY -> EVENT_TYPE_WRITE
    IN_DELETE                -> EVENT_TYPE_REMOVE       IN_ATTRIB -> EVENT_TYPE_CHMOD
    IN_MOVED_FROM            -> EVENT_TYPE_RENAME

Names are relative to the watched directory (``sub/file.txt`` in a recursive watch). A recursive
watch adds a watch for every subdirectory, including ones created (or moved in) later; what a new
subdirectory already contains when its watch is added is reported as CREATE events, so a quick
``mkdir -p a/b && touch a/b/f`` is not lost to the race. Those walks run in the thread pool (a
tree of tens of thousands of entries moved in takes seconds under emulation, and the event loop
serves every other request); the events that arrive meanwhile wait and follow the walk's, in
the order the kernel gave them.

The agent's uploads of *existing* files go through a hidden temporary file renamed over the target
(``UPLOAD_PREFIX``); watchers hide that file and report the rename as the ``WRITE`` that envd's
in-place overwrite produces.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable

from .common import (
    DISCONNECT_POLL,
    UPLOAD_PREFIX,
    CallContext,
    ConnectError,
    User,
    blocking,
    field,
    log,
)
from .fsutil import entry_info

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_ONLYDIR
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
# One record may carry several types; envd emits them in this order.
EVENT_ORDER = ((IN_CREATE | IN_MOVED_TO, "EVENT_TYPE_CREATE"), (IN_MOVED_FROM, "EVENT_TYPE_RENAME"),
               (IN_ATTRIB, "EVENT_TYPE_CHMOD"), (IN_MODIFY, "EVENT_TYPE_WRITE"),
               (IN_DELETE, "EVENT_TYPE_REMOVE"))
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "fuse", "sshfs", "9p", "ceph", "glusterfs")
MAX_BUFFERED = 65536  # events kept for a WatchDir client, and for all polling watchers together

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` is on (longest mount point prefix in /proc/self/mounts)."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                prefix = mount.rstrip("/") + "/"
                if (path == mount or path.startswith(prefix) or mount == "/") and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


class Watcher:
    """One watched directory; ``sink`` gets each ``FilesystemEvent`` as a JSON-ready dict."""

    def __init__(self, root: str, recursive: bool, include_entry: bool,
                 sink: Callable[[dict], None]) -> None:
        self.root, self.recursive, self.include_entry, self.sink = root, recursive, include_entry, sink
        self.fd = -1
        self.dirs: dict[int, str] = {}     # watch descriptor -> directory path
        self._upload_cookies: set[int] = set()
        # A walk of a new subtree runs in a thread; raw records wait in the backlog until it
        # is done. The lock keeps the thread off a descriptor that ``close`` is closing.
        self._lock = threading.Lock()
        self._walk: asyncio.Future[list[dict]] | None = None
        self._backlog: deque[tuple[int, int, int, str]] = deque()
        # Names a walk reported as CREATE: an entry made between a new watch and its scan is
        # also in the backlog as the kernel's CREATE, which is then not reported twice.
        self._scanned: set[str] = set()

    async def start(self, allow_network_mounts: bool) -> None:
        """Validate the root and add the watches (raises ConnectError); then events flow. The
        walk of a big tree runs in the thread pool, so it does not stall other requests."""
        await blocking(self._open, allow_network_mounts)
        asyncio.get_running_loop().add_reader(self.fd, self._on_readable)

    def _open(self, allow_network_mounts: bool) -> None:
        if not os.path.lexists(self.root):
            raise ConnectError("not_found", f"path '{self.root}' does not exist")
        if not os.path.isdir(self.root):
            raise ConnectError("invalid_argument", f"path '{self.root}' is not a directory")
        kind = filesystem_type(os.path.realpath(self.root))
        if not allow_network_mounts and (kind in NETWORK_FS or kind.startswith("fuse.")):
            raise ConnectError("failed_precondition",
                               f"path '{self.root}' is on a network filesystem ({kind}); "
                               "set allow_network_mounts to watch it")
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise ConnectError("resource_exhausted" if err in (errno.EMFILE, errno.ENFILE) else "internal",
                               f"inotify_init1: {os.strerror(err)}")
        try:
            self._add_tree(self.root, scan=False)
        except ConnectError:
            os.close(self.fd)
            self.fd = -1
            raise

    def close(self) -> None:
        if self.fd >= 0:
            asyncio.get_running_loop().remove_reader(self.fd)
            with self._lock:  # a walk in a thread must not add a watch to a reused descriptor
                os.close(self.fd)  # closing the inotify fd drops all its watches
                self.fd = -1
        if self._walk is not None:
            self._walk.cancel()
            self._walk = None
        self._backlog.clear()
        self._scanned.clear()

    async def settle(self) -> None:
        """Read what the kernel queued and wait for the walks it starts, so every event from
        before this call has reached the sink (``GetWatcherEvents`` answers with all of them)."""
        self.read_pending()
        while self._walk is not None:
            await asyncio.wait([self._walk])  # our own cancellation does not cancel the walk

    # ---- internals ----------------------------------------------------------------------

    def _add_tree(self, top: str, scan: bool) -> list[dict]:
        """Watch ``top`` (and, when recursive, every directory below it). With ``scan``, the
        entries already there are returned as CREATE events: they appeared before the watch
        could see them. Blocking (runs in a thread, never on the event loop); iterative, so a
        deep tree cannot exhaust the stack."""
        events: list[dict] = []
        failed: list[str] = []
        pending = [top]
        while pending:
            directory = pending.pop()
            with self._lock:
                if self.fd < 0:
                    return []  # closed meanwhile
                wd = _libc.inotify_add_watch(self.fd, os.fsencode(directory), WATCH_MASK)
                err = ctypes.get_errno()
                if wd >= 0:
                    self.dirs[wd] = directory
            if wd < 0:
                if directory == self.root:
                    code = "resource_exhausted" if err == errno.ENOSPC else "internal"
                    raise ConnectError(code, f"cannot watch '{directory}': {os.strerror(err)}")
                failed.append(f"'{directory}': {os.strerror(err)}")
                continue
            if not self.recursive and directory == self.root:
                break
            try:
                with os.scandir(directory) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            subdirs = []
            for entry in entries:
                if entry.name.startswith(UPLOAD_PREFIX):
                    continue
                if scan:
                    events.append(self._event(entry.path, "EVENT_TYPE_CREATE"))
                if self.recursive and entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.path)
            pending.extend(reversed(subdirs))
        if failed:
            log(f"watch: cannot watch {len(failed)} directories, first {failed[0]}")
        return events

    def _event(self, path: str, kind: str, name: str | None = None) -> dict:
        event: dict = {"name": name or os.path.relpath(path, self.root), "type": kind}
        if self.include_entry and kind in ("EVENT_TYPE_CREATE", "EVENT_TYPE_WRITE", "EVENT_TYPE_CHMOD"):
            try:
                event["entry"] = entry_info(path)
            except (ConnectError, OSError):
                pass
        return event

    def _emit(self, path: str, types: list[str]) -> None:
        name = os.path.relpath(path, self.root)
        for kind in types:
            self.sink(self._event(path, kind, name))

    def _start_walk(self, directory: str) -> None:
        """Watch a new subtree in the thread pool; records that arrive meanwhile wait."""
        self._walk = asyncio.ensure_future(blocking(self._add_tree, directory, True))
        self._walk.add_done_callback(self._walk_done)

    def _walk_done(self, walk: asyncio.Future[list[dict]]) -> None:
        if walk is not self._walk:
            return  # closed: its events go nowhere
        self._walk = None
        if walk.cancelled():
            return
        if (exc := walk.exception()) is not None:
            log(f"watch: adding watches below '{self.root}' failed: {exc}")
        else:
            for event in walk.result():  # CREATE events, every one
                self.sink(event)
                self._scanned.add(event["name"])
        while self._backlog and self._walk is None and self.fd >= 0:
            self._handle(*self._backlog.popleft())
        if not self._backlog and self._walk is None:
            self._scanned.clear()

    def read_pending(self) -> None:
        if self.fd >= 0:
            self._on_readable()

    def _on_readable(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return
            except OSError as exc:
                log(f"watch: reading inotify events failed: {exc}")
                self.close()
                return
            offset = 0
            while offset + EVENT_HEADER.size <= len(data):
                wd, mask, cookie, length = EVENT_HEADER.unpack_from(data, offset)
                offset += EVENT_HEADER.size
                raw_name = data[offset:offset + length].rstrip(b"\0")
                offset += length
                record = (wd, mask, cookie, os.fsdecode(raw_name))
                if self._walk is not None:
                    self._backlog.append(record)  # after the walk's own events
                else:
                    self._handle(*record)

    def _handle(self, wd: int, mask: int, cookie: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            log(f"watch: inotify queue overflow on '{self.root}', events were lost")
            return
        directory = self.dirs.get(wd)
        if directory is None:
            return
        if mask & IN_IGNORED:  # the directory is gone (or moved off the watch)
            del self.dirs[wd]
            return
        if not name:
            return  # an event about the watched directory itself; its parent reports it
        path = os.path.join(directory, name)
        if name.startswith(UPLOAD_PREFIX):
            # The agent's own temporary upload file: hidden, but its rename over the target is
            # the overwrite the client asked for, reported as envd reports one: a WRITE.
            if mask & IN_MOVED_FROM:
                self._upload_cookies.add(cookie)
            return
        if mask & IN_MOVED_TO and cookie in self._upload_cookies:
            self._upload_cookies.discard(cookie)
            self._emit(path, ["EVENT_TYPE_WRITE"])
            return
        types = [kind for bits, kind in EVENT_ORDER if mask & bits]
        scanned = False
        if (self._scanned and mask & (IN_CREATE | IN_MOVED_TO)
                and (rel := os.path.relpath(path, self.root)) in self._scanned):
            self._scanned.discard(rel)
            types.remove("EVENT_TYPE_CREATE")  # the walk reported it, and walked it if a directory
            scanned = True
        self._emit(path, types)
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO) and not scanned:
            self._start_walk(path)
        if mask & IN_ISDIR and mask & IN_MOVED_FROM:
            # A subdirectory moved away: its watches would report under a stale name.
            prefix = path + "/"
            for stale_wd in [w for w, d in self.dirs.items() if d == path or d.startswith(prefix)]:
                _libc.inotify_rm_watch(self.fd, stale_wd)
                del self.dirs[stale_wd]


class PolledWatcher:
    """A watcher whose events wait in a buffer until ``GetWatcherEvents`` drains them."""

    def __init__(self, root: str, recursive: bool, include_entry: bool,
                 sink: Callable[[PolledWatcher, dict], None]) -> None:
        self.events: deque[dict] = deque()
        self.dropped = 0
        self.watcher = Watcher(root, recursive, include_entry, lambda event: sink(self, event))


class WatchService:
    """``WatchDir`` streams and the polling watchers of the ``filesystem.Filesystem`` service."""

    def __init__(self, resolve: Callable[[str, User], str]) -> None:
        self.resolve = resolve
        self.polled: dict[str, PolledWatcher] = {}
        self._buffered = 0  # events held by all polling watchers together

    def _keep(self, polled: PolledWatcher, event: dict) -> None:
        """Buffer a polling watcher's event within one budget for all of them: watchers that
        nobody polls (a client that forgot to stop one) cannot grow the agent's memory without
        bound. When the budget is spent, the fullest buffer loses its oldest event."""
        if self._buffered >= MAX_BUFFERED:
            fullest = max(self.polled.values(), key=lambda p: len(p.events), default=polled)
            if len(fullest.events) < len(polled.events):
                fullest = polled
            if not fullest.events:
                return
            fullest.events.popleft()
            self._buffered -= 1
            if not fullest.dropped:
                log(f"watch: events of '{fullest.watcher.root}' are not being polled, dropping the oldest")
            fullest.dropped += 1
        polled.events.append(event)
        self._buffered += 1

    def _watcher_args(self, msg: dict, ctx: CallContext) -> tuple[str, bool, bool, bool]:
        return (self.resolve(msg.get("path"), ctx.user()), bool(field(msg, "recursive")),
                bool(field(msg, "includeEntry")), bool(field(msg, "allowNetworkMounts")))

    async def rpc_watch_dir(self, msg: dict, ctx: CallContext) -> AsyncIterator[dict]:
        """``{"start":{}}``, then ``{"filesystem": event}`` as they happen, with a ``{"keepalive":{}}``
        after every ``Keepalive-Ping-Interval`` without events; ends at the Connect deadline."""
        root, recursive, include_entry, allow_network = self._watcher_args(msg, ctx)
        queue: asyncio.Queue[dict] = asyncio.Queue(maxsize=MAX_BUFFERED)
        dropped = 0

        def sink(event: dict) -> None:
            nonlocal dropped
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                # Logged once: a line per dropped event would fill the agent's log (and the
                # console the host keeps) as fast as the file system changes.
                if not dropped:
                    log(f"watch: client of '{root}' is too slow, dropping events")
                dropped += 1

        watcher = Watcher(root, recursive, include_entry, sink)
        await watcher.start(allow_network)
        deadline = time.monotonic() + ctx.timeout if ctx.timeout is not None else None
        last_sent = time.monotonic()
        try:
            yield {"start": {}}
            while True:
                now = time.monotonic()
                wait = min(last_sent + ctx.keepalive - now, DISCONNECT_POLL)
                if deadline is not None:
                    if (left := deadline - now) <= 0:
                        raise ConnectError("deadline_exceeded", "watch deadline (Connect-Timeout-Ms) elapsed")
                    wait = min(wait, left)
                try:
                    event = await asyncio.wait_for(queue.get(), max(wait, 0.0))
                except TimeoutError:
                    if ctx.client_gone():
                        return  # the client went away: drop the watch
                    now = time.monotonic()
                    if now - last_sent >= ctx.keepalive and (deadline is None or now < deadline):
                        last_sent = now
                        yield {"keepalive": {}}
                    continue
                yield {"filesystem": event}
                last_sent = time.monotonic()
        finally:
            watcher.close()
            if dropped:
                log(f"watch: {dropped} events of '{root}' were dropped for a slow client")

    async def rpc_create_watcher(self, msg: dict, ctx: CallContext) -> dict:
        root, recursive, include_entry, allow_network = self._watcher_args(msg, ctx)
        polled = PolledWatcher(root, recursive, include_entry, self._keep)
        await polled.watcher.start(allow_network)
        watcher_id = os.urandom(16).hex()
        self.polled[watcher_id] = polled
        return {"watcherId": watcher_id}

    async def rpc_get_watcher_events(self, msg: dict, ctx: CallContext) -> dict:
        polled = self._get(field(msg, "watcherId"))
        await polled.watcher.settle()  # what the kernel queued but the loop has not handled yet
        events = list(polled.events)
        polled.events.clear()
        self._buffered -= len(events)
        return {"events": events} if events else {}

    async def rpc_remove_watcher(self, msg: dict, ctx: CallContext) -> dict:
        watcher_id = field(msg, "watcherId")
        polled = self._get(watcher_id)
        polled.watcher.close()
        self._buffered -= len(polled.events)
        del self.polled[watcher_id]
        return {}

    def _get(self, watcher_id: object) -> PolledWatcher:
        polled = self.polled.get(str(watcher_id or ""))
        if polled is None:
            raise ConnectError("not_found", f"watcher '{watcher_id}' not found")
        return polled
