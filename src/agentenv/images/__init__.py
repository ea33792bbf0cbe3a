"""Guest images: the kernel, the initramfs and the template root filesystems.

Everything here is built once on the host, cached under the cache dir, and rebuilt only when
its inputs change (each artifact's file name carries the hash of its inputs).
"""

from agentenv.images.artifacts import GuestArtifacts, artifacts_present
from agentenv.images.initramfs import ensure_initramfs
from agentenv.images.kernel import ensure_kernel
from agentenv.images.rootfs import BASE_PACKAGES, ensure_base_rootfs

__all__ = [
    "GuestArtifacts",
    "artifacts_present",
    "ensure_kernel",
    "ensure_initramfs",
    "ensure_base_rootfs",
    "BASE_PACKAGES",
]
