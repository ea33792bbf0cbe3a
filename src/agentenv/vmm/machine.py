"""One QEMU process and its QMP connection.

QEMU is started with ``-daemonize``: the launcher returns once QEMU has finished initialising
(so the QMP socket is ready) and QEMU is no longer our child. It therefore outlives the server
and can be adopted again after a restart from its pid file (``Machine.adopt``). Exit is watched
through a pidfd, which works the same for launched and adopted processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient
from qemu.qmp.error import QMPError

from agentenv.errors import VmmError
from agentenv.vmm import priority
from agentenv.vmm.spec import MachineSpec, build_argv

log = logging.getLogger(__name__)

# A QEMU that takes the connection but never greets (stopped, or stuck in the kernel) is not
# one to drive: without a bound, adopting it held up the server's start for good.
QMP_CONNECT_TIMEOUT_S = 10.0


class VmLaunchFailed(VmmError):
    """QEMU did not start; carries its command line and output."""

    def __init__(self, argv: list[str], output: str) -> None:
        super().__init__(f"QEMU failed to start: {output.strip()[-1500:]}")
        self.argv = argv
        self.output = output


class Machine:
    """A running (or incoming) QEMU microvm."""

    # A QEMU that takes a command and never answers (stopped, frozen, stuck draining a disk
    # that hangs) is killed after this long, and the command fails: a pause or snapshot waits
    # on QMP while it holds the node's repository lock, so one hung VM froze every pause,
    # snapshot, fork, resume and gc of the node. The server sets it (AENV_QMP_TIMEOUT).
    qmp_timeout_s: float = 60.0

    def __init__(self, spec: MachineSpec, pid: int, qmp: QMPClient) -> None:
        self.spec = spec
        self.pid = pid
        self._qmp = qmp
        self._exit = asyncio.get_running_loop().create_future()
        self._pidfd: int | None = None
        self._lowered = False  # launched at a lower CPU priority (vmm/priority.py)
        self._watch()

    def __repr__(self) -> str:
        return f"<Machine {self.spec.name} pid={self.pid} {'exited' if self.exited else 'alive'}>"

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    async def launch(cls, spec: MachineSpec, nice: int = 0) -> Machine:
        """Start QEMU and connect QMP. Raises VmLaunchFailed with QEMU's own message. ``nice``:
        how many nice values below the server it runs from the end of its start-up on
        (vmm/priority.py: a VM made ahead of time runs behind live ones until ``foreground``)."""
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        spec.sock_dir.mkdir(parents=True, exist_ok=True)
        pidfile = spec.run_dir / "qemu.pid"
        pidfile.unlink(missing_ok=True)
        spec.qmp_path.unlink(missing_ok=True)
        argv = build_argv(spec) + ["-display", "none", "-daemonize", "-pidfile", str(pidfile)]
        # -nographic conflicts with -daemonize; -display none is its equivalent here.
        argv.remove("-nographic")
        # QEMU's output goes to a file and the launch ends when the launcher exits, not at
        # end-of-file on a pipe: an event loop may leak a descriptor of that pipe into the child
        # (uvloop does), and the daemonized QEMU would then hold it open for its whole life.
        log_path = spec.run_dir / "qemu-launch.log"
        with open(log_path, "wb") as log_file:
            launcher = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
        try:
            await launcher.wait()
        except asyncio.CancelledError:
            # The launcher goes on and may still daemonize a QEMU: wait for it, kill what it
            # started, then let the cancellation through. Nothing is left running.
            await asyncio.shield(_abandon_launch(launcher, pidfile))
            raise
        if launcher.returncode != 0:
            raise VmLaunchFailed(argv, log_path.read_text(errors="replace"))
        pid = int(pidfile.read_text().strip())
        try:
            lowered = priority.lower(pid, nice) if nice else False  # best effort
            machine = await cls._connect(spec, pid)
        except BaseException:
            kill_pid(pid)  # failed or cancelled before QMP was up: nobody holds this QEMU
            raise
        machine._lowered = lowered
        return machine

    @classmethod
    async def adopt(cls, spec: MachineSpec) -> Machine:
        """Re-attach to a QEMU left running by a previous server process."""
        pidfile = spec.run_dir / "qemu.pid"
        try:
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError) as exc:
            raise VmmError(f"QEMU of {spec.name} is gone ({exc})") from exc
        if str(spec.qmp_path).encode() not in cmdline:
            raise VmmError(f"pid {pid} is no longer the QEMU of {spec.name}")
        return await cls._connect(spec, pid)

    @classmethod
    async def _connect(cls, spec: MachineSpec, pid: int) -> Machine:
        qmp = QMPClient(spec.name)
        try:
            await asyncio.wait_for(qmp.connect(str(spec.qmp_path)), QMP_CONNECT_TIMEOUT_S)
        except (QMPError, OSError, TimeoutError) as exc:
            kill_pid(pid)
            why = f"no QMP greeting within {QMP_CONNECT_TIMEOUT_S:.0f} s" if isinstance(exc, TimeoutError) else exc
            raise VmmError(f"cannot connect QMP of {spec.name}: {why}") from exc
        return cls(spec, pid, qmp)

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._exit.set_result(None)
            return
        loop.add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if not self._exit.done():
            self._exit.set_result(None)

    @property
    def exited(self) -> bool:
        return self._exit.done()

    def alive(self) -> bool:
        """Whether QEMU still runs, asked of the kernel now (its pidfd): ``exited`` turns true
        only once the event loop has handled the exit."""
        if self.exited or self._pidfd is None:
            return not self.exited
        poller = select.poll()  # (not select.select: descriptors past 1024 are common on a busy node)
        poller.register(self._pidfd, select.POLLIN)
        return not poller.poll(0)

    async def wait_exit(self) -> None:
        await asyncio.shield(self._exit)

    def on_exit(self, callback: Callable[[], None]) -> None:
        self._exit.add_done_callback(lambda _f: callback())

    async def _disconnect(self) -> None:
        """Close QMP. ``disconnect`` re-raises whatever ended the reader (EOFError when QEMU
        died first), which is expected here and carries no information we need."""
        try:
            await asyncio.wait_for(self._qmp.disconnect(), 0.5)
        except Exception:  # noqa: BLE001 — cleanup path
            pass

    async def kill(self) -> None:
        """SIGKILL and wait until the process is gone (bounded). Idempotent. The signal is
        sent even if the caller is cancelled while the QMP connection closes."""
        try:
            await self._disconnect()
        finally:
            if not self.exited:
                kill_pid(self.pid)
        if not self.exited:
            try:
                await asyncio.wait_for(self.wait_exit(), 5)
            except TimeoutError as exc:
                raise VmmError(f"QEMU {self.pid} did not exit after SIGKILL") from exc
        self.spec.qmp_path.unlink(missing_ok=True)

    async def detach(self) -> None:
        """Drop our QMP connection and watcher but leave QEMU running (server shutdown)."""
        await self._disconnect()
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def foreground(self) -> None:
        """Run at the CPU priority of every live sandbox, if it was launched below it."""
        if self._lowered and not self.exited:
            priority.restore(self.pid)
        self._lowered = False

    # -- QMP -----------------------------------------------------------------------------

    async def qmp(self, command: str, **arguments: Any) -> Any:
        """Run one QMP command; QMP failures become VmmError naming the command."""
        if self.exited:
            raise VmmError(f"QEMU of {self.spec.name} has exited")
        call = asyncio.ensure_future(self._qmp.execute(command, arguments or None))
        try:
            # (not wait_for: the QMP client turns its cancellation into an error of its own)
            done, _ = await asyncio.wait({call}, timeout=self.qmp_timeout_s)
        except BaseException:  # the caller was cancelled: so is the command (its outcome unread)
            call.cancel()
            call.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise
        if not done:
            log.error("QEMU of %s did not answer QMP %s within %.0f s: killing it", self.spec.name, command,
                      self.qmp_timeout_s)
            kill_pid(self.pid)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            raise VmmError(f"QEMU of {self.spec.name} did not answer QMP {command} within "
                           f"{self.qmp_timeout_s:.0f} s (AENV_QMP_TIMEOUT) and was killed")
        try:
            return call.result()
        except (QMPError, OSError) as exc:
            raise VmmError(f"QMP {command} failed on {self.spec.name}: {exc}") from exc

    async def status(self) -> str:
        res = await self.qmp("query-status")
        return str(res["status"])

    async def save_template_state(self, state_path: Path) -> None:
        """Stop and write the device state only; RAM stays in the shared memory file
        (x-ignore-shared), so the cost does not depend on the RAM size (notes §4)."""
        await self.qmp("stop")
        await self.qmp("migrate-set-capabilities",
                       capabilities=[{"capability": "x-ignore-shared", "state": True}])
        tmp = state_path.with_suffix(".partial")
        await self.qmp("migrate", uri=f"exec:cat > {tmp}")
        await self._wait_migration()
        os.replace(tmp, state_path)

    async def save_device_state(self, path: Path) -> None:
        """Write the device state alone (no RAM) of a stopped machine; repeatable, unlike
        ``migrate`` (qemu-microvm-notes.md §8.1, §10)."""
        await self.qmp("xen-save-devices-state", filename=str(path), live=False)

    async def switch_disk(self, overlay: Path) -> None:
        """Make ``overlay`` (a qcow2 created over the current top's sealed copy) the disk's new
        top: the current top becomes a read-only backing file and receives no more writes."""
        blocks = await self.qmp("query-block")
        current = next(b["inserted"]["node-name"] for b in blocks if b.get("device") == "d0")
        node = "top" + os.urandom(4).hex()
        await self.qmp("blockdev-add", **{
            "driver": "qcow2", "node-name": node, "discard": "unmap", "backing": None,
            "cache": {"direct": False, "no-flush": True},
            "file": {"driver": "file", "filename": str(overlay)}})
        try:
            await self.qmp("blockdev-snapshot", node=current, overlay=node)
        except VmmError:
            await self.qmp("blockdev-del", **{"node-name": node})
            raise

    async def stream_disk(self, base: Path) -> bool:
        """Start a QEMU ``block-stream`` job that copies every layer between the disk's top and
        ``base`` into the top, then makes ``base`` the top's backing file: the chain is
        bounded while the guest keeps running. False if ``base`` is not in the chain."""
        blocks = await self.qmp("query-block")
        top = next(b["inserted"]["node-name"] for b in blocks if b.get("device") == "d0")
        nodes = await self.qmp("query-named-block-nodes")
        base_node = next((n["node-name"] for n in nodes if n.get("drv") == "qcow2" and n.get("file") == str(base)),
                         None)
        if base_node is None:
            return False
        await self.qmp("block-stream", **{"job-id": "stream-" + os.urandom(4).hex(), "device": top,
                                          "base-node": base_node})
        return True

    async def wait_jobs(self, timeout: float = 600.0) -> None:
        """Wait until no block job runs (a checkpoint must not seal a disk being streamed)."""
        deadline = time.monotonic() + timeout
        while await self.qmp("query-block-jobs"):
            if time.monotonic() > deadline:
                raise VmmError(f"block job of {self.spec.name} still running after {timeout:.0f}s")
            await asyncio.sleep(0.05)

    async def disk_top(self) -> Path:
        """The overlay the disk writes to, as QEMU sees it (recovery trusts this over records)."""
        blocks = await self.qmp("query-block")
        name = next(b["inserted"]["file"] for b in blocks if b.get("device") == "d0")
        if name.startswith("json:"):  # a top added at run time is described with its backing
            name = json.loads(name[5:])["file"]["filename"]
        return Path(name)

    async def _wait_migration(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            res = await self.qmp("query-migrate")
            st = res.get("status")
            if st == "completed":
                return
            if st in ("failed", "cancelled"):
                raise VmmError(f"migration of {self.spec.name} {st}: {res.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise VmmError(f"migration of {self.spec.name} did not finish in {timeout}s")
            await asyncio.sleep(0.002)

    async def prepare_incoming(self) -> None:
        """Done ahead of time for pooled machines: enable x-ignore-shared on the destination."""
        await self.qmp("migrate-set-capabilities",
                       capabilities=[{"capability": "x-ignore-shared", "state": True}])

    async def load_state(self, state_path: Path, timeout: float = 20.0, run: bool = True) -> None:
        """Load a device state into an -incoming defer machine and let the guest run (with
        ``run=False`` it stays stopped until a ``cont``)."""
        await self.qmp("migrate-incoming", uri=f"exec:cat {state_path}")
        deadline = time.monotonic() + timeout
        while True:
            st = await self.status()
            if st not in ("inmigrate",):
                break
            if time.monotonic() > deadline:
                raise VmmError(f"{self.spec.name} still loading its state after {timeout}s")
            await asyncio.sleep(0.001)
        if st == "paused" or st == "postmigrate":
            if run:
                await self.qmp("cont")
        elif st != "running":
            raise VmmError(f"{self.spec.name} is {st} after loading its state")


async def _abandon_launch(launcher: asyncio.subprocess.Process, pidfile: Path) -> None:
    await launcher.wait()
    try:
        kill_pid(int(pidfile.read_text().strip()))
    except (OSError, ValueError):
        pass


def find_qemu_pids(marker: str) -> dict[int, str]:
    """QEMU processes whose command line contains ``marker``: pid → the ``-name`` they run as.
    Recovery uses it to find machines that no record and no run dir owns any more."""
    out: dict[int, str] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            args = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"qemu-system-x86_64") and marker.encode() in b" ".join(args):
            name = args[args.index(b"-name") + 1].decode() if b"-name" in args else ""
            out[int(p.name)] = name
    return out


def kill_pid(pid: int) -> None:
    """SIGKILL, ignoring a process that is already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
