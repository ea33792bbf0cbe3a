"""Settings: the one place configuration is read.

Only ``server.py``, ``cli/`` and the benchmark's node (``bench/``) call ``Settings.from_env``;
every other module receives the values it needs as arguments (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

Accel = Literal["auto", "kvm", "tcg"]

# The guest CPU under TCG: QEMU's "max" model without ERMS ("enhanced rep movsb"). With ERMS the
# guest kernel copies to and from user memory, and glibc's memcpy copies large blocks, with
# `rep movsb`, which TCG runs one byte per iteration; without it they use `rep movsq` or vector
# loops, 8+ bytes per iteration. Copying a 30 MB file measured ~1.8x faster inside the guest
# (docs/mechanisms/machines.md). A saved machine is restored with the model it was saved with
# (TemplateSnapshot.tcg_cpu), never with this default.
DEFAULT_TCG_CPU = "max,-erms"


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclass(frozen=True)
class Settings:
    """Everything a node needs to know. Defaults are the embedded single-node setup."""

    data_dir: Path = Path("/var/lib/agentenv")
    cache_dir: Path | None = None  # kernel, initramfs and rootfs builds; default data_dir/cache
    mem_root: Path = Path("/dev/shm/agentenv")  # tmpfs for template memory files
    host: str = "127.0.0.1"
    port: int = 8000
    accel: Accel = "auto"
    slot_cidr: str = "10.213.0.0/16"  # host-side addresses of sandbox namespaces, a /30 each
    max_sandboxes: int = 64
    mem_reserve_mb: int = 1024  # host memory new sandboxes never eat into (orchestrator/capacity.py)
    max_vcpus: int = 8
    max_memory_mb: int = 8192
    default_timeout_s: int = 300
    max_timeout_s: int = 24 * 3600
    pool_size: int = 16  # restored, frozen sandboxes kept per hot template (a GRPO group's worth)
    snapshot_pool_size: int = 2  # the same per snapshot sandboxes were started from (orchestrator/snapshot_shells.py)
    snapshot_pool_max: int = 16  # ... grown to its largest burst of starts (a GRPO group's reset), up to this
    snapshot_pool_idle_s: float = 300.0  # ... until nothing was started from it for this long
    background_nice: int = 10  # CPU priority of VMs made ahead of time (pools) until handed out: vmm/priority.py
    slot_pool_size: int = 20  # network namespaces kept ready: a fork of max_fork children waits for none
    boot_timeout_s: float = 120.0  # cold boot until the agent answers (TCG is slow)
    restore_timeout_s: float = 20.0  # restore until the agent answers
    qmp_timeout_s: float = 60.0  # a QMP command QEMU does not answer in this long: that QEMU is killed
    tcg_tb_size_mb: int = 128  # TCG translation cache per VM (MiB, filled as used): see machines.md
    tcg_cpu: str = DEFAULT_TCG_CPU  # QEMU -cpu under TCG for new template snapshots (see above)
    guest_aslr: bool = False  # under TCG, ASLR in the guest makes every exec 2-3x slower
    ksm: bool = False  # merge identical pages across QEMU processes (one tenant only: vmm/ksm.py)
    dns: bool = True  # guests resolve names through the host's forwarder (network/dns.py)
    dns_upstream: str = ""  # comma-separated resolvers for it; default: the host's /etc/resolv.conf
    deny_out: str = ""  # comma-separated IPv4 networks no sandbox reaches, whatever its policy
    deny_uplink: bool = True  # ... and the network of the host's uplink (network/slots.py uplink_networks)
    max_fork: int = 20  # children per fork call (the E2B SDKs allow up to 20)
    max_memory_layers: int = 8  # a longer memory chain is compacted into one layer
    max_disk_layers: int = 16  # a longer disk chain is streamed into the sandbox's overlay
    pause_on_stop: bool = False  # SIGTERM pauses running sandboxes instead of leaving them running
    pause_linger_s: float = 60.0  # a paused sandbox's stopped VM is kept this long (orchestrator/parking.py)
    error_keep_s: float = 600.0  # a failed sandbox stays listed at least this long, then goes at its timeout
    repository_dir: Path | None = None  # snapshot repository (posix_fs); default data_dir/repository
    spare_layers_mb: int = 512  # freed memory layers kept for captures to write over (storage/spares.py)
    api_key: str | None = None  # overrides the generated key file
    faults: frozenset[str] = frozenset()  # injected fault points, for tests only (AENV_FAULTS)
    # Sandbox host names are {port}-{sandboxID}.{domain} (E2B's scheme): returned to SDKs as
    # `domain` and used by the proxy to route by Host. None: SDKs use their own E2B_DOMAIN and
    # the proxy accepts {port}-{id}.<any domain>.
    domain: str | None = None
    # Serve HTTPS (E2B SDK 1.x only speaks https to https://api.{domain} and {port}-{id}.{domain}).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Template builds (orchestrator/builds): concurrent builds, the default bound of a ready
    # command, and the largest COPY upload accepted.
    max_builds: int = 2
    build_ready_timeout_s: float = 120.0
    build_step_timeout_s: float = 3600.0  # a RUN step that runs longer fails the build
    build_upload_max_mb: int = 1024

    @classmethod
    def from_env(cls) -> Settings:
        """Build settings from AENV_* environment variables (unset ⇒ default)."""
        d = cls()
        s = replace(
            d,
            data_dir=Path(_env("AENV_DATA_DIR", str(d.data_dir))),
            cache_dir=Path(os.environ["AENV_CACHE_DIR"]) if "AENV_CACHE_DIR" in os.environ else None,
            mem_root=Path(_env("AENV_MEM_DIR", str(d.mem_root))),
            host=_env("AENV_HOST", d.host),
            port=int(_env("AENV_PORT", str(d.port))),
            accel=_env("AENV_ACCEL", d.accel),  # type: ignore[arg-type]
            slot_cidr=_env("AENV_SLOT_CIDR", d.slot_cidr),
            max_sandboxes=int(_env("AENV_MAX_SANDBOXES", str(d.max_sandboxes))),
            mem_reserve_mb=int(_env("AENV_MEM_RESERVE_MB", str(d.mem_reserve_mb))),
            pool_size=int(_env("AENV_POOL_SIZE", str(d.pool_size))),
            snapshot_pool_size=int(_env("AENV_SNAPSHOT_POOL_SIZE", str(d.snapshot_pool_size))),
            snapshot_pool_max=int(_env("AENV_SNAPSHOT_POOL_MAX", str(d.snapshot_pool_max))),
            snapshot_pool_idle_s=float(_env("AENV_SNAPSHOT_POOL_IDLE_S", str(d.snapshot_pool_idle_s))),
            slot_pool_size=int(_env("AENV_SLOT_POOL_SIZE", str(d.slot_pool_size))),
            background_nice=int(_env("AENV_BACKGROUND_NICE", str(d.background_nice))),
            api_key=os.environ.get("AENV_API_KEY"),
            max_fork=int(_env("AENV_MAX_FORK", str(d.max_fork))),
            max_memory_layers=int(_env("AENV_MAX_MEMORY_LAYERS", str(d.max_memory_layers))),
            max_disk_layers=int(_env("AENV_MAX_DISK_LAYERS", str(d.max_disk_layers))),
            pause_on_stop=_env("AENV_PAUSE_ON_STOP", "0") in ("1", "true", "on"),
            pause_linger_s=float(_env("AENV_PAUSE_LINGER_S", str(d.pause_linger_s))),
            error_keep_s=float(_env("AENV_ERROR_KEEP_S", str(d.error_keep_s))),
            repository_dir=Path(os.environ["AENV_REPOSITORY_DIR"]) if "AENV_REPOSITORY_DIR" in os.environ else None,
            spare_layers_mb=int(_env("AENV_SPARE_LAYERS_MB", str(d.spare_layers_mb))),
            boot_timeout_s=float(_env("AENV_BOOT_TIMEOUT", str(d.boot_timeout_s))),
            restore_timeout_s=float(_env("AENV_RESTORE_TIMEOUT", str(d.restore_timeout_s))),
            qmp_timeout_s=float(_env("AENV_QMP_TIMEOUT", str(d.qmp_timeout_s))),
            tcg_tb_size_mb=int(_env("AENV_TCG_TB_MB", str(d.tcg_tb_size_mb))),
            tcg_cpu=_env("AENV_TCG_CPU", d.tcg_cpu) or d.tcg_cpu,
            guest_aslr=_env("AENV_GUEST_ASLR", "0") in ("1", "true", "on"),
            ksm=_env("AENV_KSM", "0") in ("1", "true", "on"),
            dns=_env("AENV_DNS", "on") not in ("0", "false", "off"),
            dns_upstream=_env("AENV_DNS_UPSTREAM", ""),
            deny_out=_env("AENV_DENY_OUT", ""),
            deny_uplink=_env("AENV_DENY_UPLINK", "on") not in ("0", "false", "off"),
            faults=frozenset(f for f in _env("AENV_FAULTS", "").split(",") if f),
            domain=os.environ.get("AENV_DOMAIN") or None,
            tls_cert=Path(os.environ["AENV_TLS_CERT"]) if os.environ.get("AENV_TLS_CERT") else None,
            tls_key=Path(os.environ["AENV_TLS_KEY"]) if os.environ.get("AENV_TLS_KEY") else None,
            max_builds=int(_env("AENV_MAX_BUILDS", str(d.max_builds))),
            build_ready_timeout_s=float(_env("AENV_BUILD_READY_TIMEOUT", str(d.build_ready_timeout_s))),
            build_step_timeout_s=float(_env("AENV_BUILD_STEP_TIMEOUT", str(d.build_step_timeout_s))),
            build_upload_max_mb=int(_env("AENV_BUILD_UPLOAD_MAX_MB", str(d.build_upload_max_mb))),
        )
        s.validate()
        return s

    def validate(self) -> None:
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"AENV_ACCEL must be auto, kvm or tcg, not {self.accel!r}")
        if not self.qmp_timeout_s > 0:
            raise ValueError(f"AENV_QMP_TIMEOUT must be a number of seconds above 0, not {self.qmp_timeout_s}")
        if not 0 <= self.background_nice <= 19:
            raise ValueError(f"AENV_BACKGROUND_NICE must be a nice value from 0 (off) to 19, not {self.background_nice}")
        net = ipaddress.ip_network(self.slot_cidr)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both AENV_TLS_CERT and AENV_TLS_KEY, or neither")
        if net.prefixlen > 28:
            raise ValueError(f"slot CIDR {self.slot_cidr} is too small; use a /28 or larger")

    @property
    def cache(self) -> Path:
        return self.cache_dir or self.data_dir / "cache"

    @property
    def mem_dir(self) -> Path:
        """Per-data-dir folder on tmpfs, so two servers (e.g. bench) never share memory files."""
        return self.mem_root / self.instance_tag

    @property
    def instance_tag(self) -> str:
        """Short tag naming this node's host objects (namespaces, nft table, memory dir)."""
        return hashlib.sha256(str(self.data_dir.resolve()).encode()).hexdigest()[:10]

    @property
    def sock_dir(self) -> Path:
        """QMP sockets: a short path whatever the data dir (Unix socket paths ≤ 107 bytes)."""
        return Path("/run/agentenv") / self.instance_tag

    @property
    def repository(self) -> Path:
        return self.repository_dir or self.data_dir / "repository"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "state.sqlite"
