"""The tools drive: the guest agent and everything it runs on, on one read-only ext4 image
shared by every template, so a template's image needs nothing of ours (busybox, alpine and
distroless images work as well as Debian ones).

The drive is mounted at ``/run/agentenv`` (``MOUNT``) in every guest and holds:

    init                 PID 1 after the initramfs: guest network, mounts, the agent's namespace
    agent-loop           runs the agent, again when it dies
    bin/busybox          static busybox for ``init`` (the image may have no shell at all)
    lib/                 glibc's loader and every shared library the binaries need, and
                         libaenvspawn.so, which starts user processes (guest/spawn.c, built here)
    python/              CPython 3.11 (binary + standard library, byte-compiled) that runs the agent
    agent/               the guest agent (``agent.py`` + ``agentlib/``, byte-compiled)
    VERSION              the drive's version: the hash of all of the above

The binaries come from the same Debian tree as the default template and are pointed at
``lib/`` with patchelf (interpreter + DT_RPATH), so they never load the image's libc and need
no environment variables that would leak into user processes. The version is part of every
template snapshot's identity, so a new drive makes new snapshots.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from agentenv.durable import publish
from agentenv.errors import ProvisioningError
from agentenv.images.artifacts import inputs_hash, remove_images_except
from agentenv.proc import run_sync

MOUNT = "/run/agentenv"
_RECIPE = "3"  # bump when the way the drive is built changes (2: byte-compiled Python, 3: spawn library)
PYTHON_VERSION = "3.11"
_ARCH_LIBDIR = "usr/lib/x86_64-linux-gnu"
_LOADER = "ld-linux-x86-64.so.2"
# Parts of the standard library the agent never imports: 60% of its size.
_STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                "distutils", "unittest", "venv", "config-3.11-x86_64-linux-gnu", "__pycache__"}


def guest_files() -> dict[str, bytes]:
    """The drive's own files by path: the init and the agent (``agent.py`` + ``agentlib/``)."""
    g = resources.files("agentenv.guest")
    files = {"init": g.joinpath("init.sh").read_bytes(), "agent-loop": g.joinpath("agent-loop.sh").read_bytes(),
             "agent/agent.py": g.joinpath("agent.py").read_bytes(),
             "src/spawn.c": g.joinpath("spawn.c").read_bytes()}
    for module in sorted(g.joinpath("agentlib").iterdir(), key=lambda m: m.name):
        if module.name.endswith(".py"):
            files[f"agent/agentlib/{module.name}"] = module.read_bytes()
    return files


def ensure_tools_drive(cache: Path, debian_tarball: Path, busybox: Path = Path("/bin/busybox")) -> Path:
    """``<cache>/tools/tools-<version>.ext4`` (0444), built when any input changed."""
    if not busybox.exists():
        raise ProvisioningError(f"{busybox} not found: install busybox-static")
    for tool, package in (("patchelf", "patchelf"), ("gcc", "gcc and libc6-dev")):
        if shutil.which(tool) is None:
            raise ProvisioningError(f"{tool} not found: install the Debian package {package} (`aenv setup` does)")
    files = guest_files()
    version = inputs_hash(_RECIPE, debian_tarball.name, busybox.read_bytes(),
                          *(k.encode() + v for k, v in sorted(files.items())))
    out = cache / "tools" / f"tools-{version}.ext4"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        debian = Path(tmp) / "debian"
        debian.mkdir()
        run_sync(["tar", "-xf", str(debian_tarball), "-C", str(debian),
                  f"./{_ARCH_LIBDIR}", f"./usr/lib/python{PYTHON_VERSION}", f"./usr/bin/python{PYTHON_VERSION}"])
        tree = Path(tmp) / "tree"
        _assemble(tree, debian, busybox, files, version)
        img = Path(tmp) / "tools.ext4"
        size_mb = _tree_mb(tree) * 5 // 4 + 16
        run_sync(["mkfs.ext4", "-q", "-F", "-L", "aenv-tools", "-O", "^has_journal", "-m", "0",
                  "-E", "root_owner=0:0", "-d", str(tree), str(img), f"{size_mb}M"])
        os.chmod(img, 0o444)
        publish(img, out)
    return out


def version_of(drive: Path) -> str:
    """The version a drive's file name carries (``tools-<version>.ext4``)."""
    return drive.stem.removeprefix("tools-")


def remove_stale(cache: Path, keep: set[Path]) -> None:
    """Delete drives of older versions (a new agent or Python makes a new drive)."""
    remove_images_except(cache / "tools", "tools-*.ext4", keep)


def _assemble(tree: Path, debian: Path, busybox: Path, files: dict[str, bytes], version: str) -> None:
    (tree / "bin").mkdir(parents=True)
    shutil.copy2(busybox, tree / "bin" / "busybox")
    (tree / "bin" / "sh").symlink_to("busybox")
    py = tree / "python"
    (py / "bin").mkdir(parents=True)
    shutil.copy2(debian / f"usr/bin/python{PYTHON_VERSION}", py / "bin" / "python3")
    stdlib = debian / f"usr/lib/python{PYTHON_VERSION}"
    shutil.copytree(stdlib, py / "lib" / f"python{PYTHON_VERSION}", symlinks=True,
                    ignore=lambda _d, names: [n for n in names if n in _STDLIB_SKIP or n.endswith(".pyc")])
    elfs = [py / "bin" / "python3"]
    dynload = sorted((py / "lib" / f"python{PYTHON_VERSION}" / "lib-dynload").glob("*.so"))
    _copy_libraries(tree / "lib", debian / _ARCH_LIBDIR, [*elfs, *dynload])
    for exe in elfs:
        run_sync(["patchelf", "--set-interpreter", f"{MOUNT}/lib/{_LOADER}", "--force-rpath",
                  "--set-rpath", f"{MOUNT}/lib", str(exe)])
    for rel, data in files.items():
        p = tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(0o755 if rel in ("init", "agent-loop") else 0o644)
    build_spawn_library(tree / "src" / "spawn.c", tree / "lib" / SPAWN_LIBRARY)
    _byte_compile(tree)
    (tree / "VERSION").write_text(version + "\n")


SPAWN_LIBRARY = "libaenvspawn.so"


def build_spawn_library(source: Path, out: Path) -> None:
    """Compile guest/spawn.c into the shared library the agent starts every process with. It
    links against the drive's own glibc (the same Debian release as the build host's)."""
    run_sync(["gcc", "-shared", "-fPIC", "-O2", "-s", "-Wall", "-Werror", "-o", str(out), str(source)])


def _byte_compile(tree: Path) -> None:
    """Byte-compile the standard library and the agent with the drive's own interpreter (run
    through the drive's loader). The drive is read-only, so without .pyc files every start of
    the agent compiles ~80 modules from source: seconds under TCG, on each cold boot and after
    each agent restart. ``unchecked-hash``: the drive never changes under its version, so no
    import needs to stat a source file; paths are recorded as the guest sees them."""
    run_sync([str(tree / "lib" / _LOADER), "--library-path", str(tree / "lib"), str(tree / "python" / "bin" / "python3"),
              "-E", "-s", "-S", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
              "-s", str(tree), "-p", MOUNT, str(tree / "python" / "lib" / f"python{PYTHON_VERSION}"), str(tree / "agent")])


def _copy_libraries(dest: Path, libdir: Path, elfs: list[Path]) -> None:
    """Copy the loader and the transitive shared-library closure of ``elfs`` from ``libdir``."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted, queue = {_LOADER}, list(elfs)
    while queue:
        for soname in _needed(queue.pop()):
            if soname not in wanted:
                wanted.add(soname)
                src = libdir / soname
                if not src.exists():
                    raise ProvisioningError(f"tools drive: library {soname} not found in {libdir}")
                queue.append(src)
    for soname in sorted(wanted):
        shutil.copyfile(libdir / soname, dest / soname)  # follows the soname symlink
        (dest / soname).chmod(0o755)


def _needed(elf: Path) -> list[str]:
    out = subprocess.run(["patchelf", "--print-needed", str(elf)], capture_output=True, text=True, check=True)
    return out.stdout.split()


def _tree_mb(tree: Path) -> int:
    total = sum(p.lstat().st_size for p in tree.rglob("*"))
    return total // (1 << 20) + 1
