"""Host objects of nodes whose data dir is gone.

What a node keeps outside its data dir is named after a hash of the data dir's path
(``Settings.instance_tag``): the template memory files on tmpfs (``mem_dir``: RAM, some
hundred MB per template shape), the QMP socket folder (``sock_dir``), the host nft table and
the slots' namespaces. A node cleans its own at start (recovery) and a throwaway node (bench,
tests) on its way out; but when a data dir disappears without that (a temporary node killed
hard, a data dir moved or deleted), nothing would ever remove them, and tmpfs keeps the memory
until the host reboots.

So each node writes its data dir's path into its socket folder at start (``record_owner``),
and at start removes the objects of every other node whose recorded data dir no longer exists
(``remove_leftovers``). A QEMU process still using a node's folders keeps all of that node's
objects, whatever happened to its data dir: a sandbox is never torn down from under a running
machine by a sweep. Folders written by versions before the record are left alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import Settings
from agentenv.network import remove_node_network
from agentenv.storage import remove_stale_staging
from agentenv.vmm import find_qemu_pids

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"


@dataclass(frozen=True)
class NodeFolders:
    tag: str
    data_dir: Path
    sock_dir: Path
    mem_dir: Path


def record_owner(settings: Settings) -> None:
    """Write which data dir this node's socket folder (and its memory folder) belong to."""
    settings.sock_dir.mkdir(parents=True, exist_ok=True)
    owner = {"dataDir": str(settings.data_dir.resolve()), "memDir": str(settings.mem_dir)}
    (settings.sock_dir / OWNER_FILE).write_text(json.dumps(owner))


def recorded_nodes(run_root: Path) -> list[NodeFolders]:
    """Every node that recorded its owner under ``run_root`` (the parent of socket folders)."""
    out = []
    for f in sorted(run_root.glob(f"*/{OWNER_FILE}")) if run_root.is_dir() else ():
        try:
            owner = json.loads(f.read_text())
            out.append(NodeFolders(f.parent.name, Path(owner["dataDir"]), f.parent, Path(owner["memDir"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written by a node killed at start: its own next start rewrites it
    return out


def orphaned(nodes: list[NodeFolders]) -> tuple[list[NodeFolders], set[str]]:
    """The nodes whose data dir is gone and that no QEMU uses, and the network-name prefixes
    (first four characters of the tag) of the others, which must not be touched."""
    gone, kept = [], set()
    for n in nodes:
        in_use = find_qemu_pids(f"{n.sock_dir}/") or find_qemu_pids(f"{n.mem_dir}/")
        if n.data_dir.exists() or in_use:
            kept.add(n.tag[:4])
        else:
            gone.append(n)
    return gone, kept


def _unrecorded_prefixes(run_root: Path, recorded: set[str]) -> set[str]:
    """Network-name prefixes of nodes that recorded no owner (an older version): alive to us."""
    return {d.name[:4] for d in run_root.iterdir() if d.is_dir() and d.name not in recorded}


async def remove_leftovers(settings: Settings) -> list[str]:
    """Remove the host objects of other nodes whose data dir is gone (see the module doc)."""
    nodes = [n for n in await asyncio.to_thread(recorded_nodes, settings.sock_dir.parent)
             if n.tag != settings.instance_tag]
    gone, kept = await asyncio.to_thread(orphaned, nodes)
    kept.add(settings.instance_tag[:4])
    kept |= await asyncio.to_thread(_unrecorded_prefixes, settings.sock_dir.parent, {n.tag for n in nodes})
    removed: list[str] = []
    for n in gone:
        removed += await remove_node_objects(n.tag, n.mem_dir, n.sock_dir, network=n.tag[:4] not in kept)
        log.info("removed the host objects of node %s, whose data dir %s is gone", n.tag, n.data_dir)
    removed += await asyncio.to_thread(remove_stale_staging)
    return removed


async def remove_node_objects(tag: str, mem_dir: Path, sock_dir: Path, network: bool = True) -> list[str]:
    """Everything a node keeps outside its data dir: namespaces and host table (unless
    ``network`` is False: a live node shares their names), memory folder, socket folder.
    For a node that is gone, or a throwaway one on its way out (``LocalNode.kill_all``)."""
    removed = await remove_node_network(tag) if network else []
    await asyncio.to_thread(shutil.rmtree, mem_dir, True)
    await asyncio.to_thread(shutil.rmtree, sock_dir, True)
    return [*removed, str(mem_dir), str(sock_dir)]
