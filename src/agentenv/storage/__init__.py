"""Disk state: qcow2 overlays on read-only bases, and the files of template snapshots.

See docs/mechanisms/snapshots.md.
"""

from agentenv.storage.overlays import create_overlay, remove_tree, seal_readonly
from agentenv.storage.template_snapshot import TemplateSnapshot

__all__ = ["create_overlay", "remove_tree", "seal_readonly", "TemplateSnapshot"]
