"""Disk and memory state: qcow2 overlays, template snapshots, memory layers and the snapshot
repository.

See docs/mechanisms/snapshots.md and docs/mechanisms/checkpoints.md.
"""

from agentenv.storage.overlays import (
    backing_chain,
    create_overlay,
    create_overlay_over,
    remove_stale_staging,
    remove_tree,
    seal_readonly,
)
from agentenv.storage.repository import (
    Checkpoint,
    LayerRef,
    SnapshotRepository,
    new_checkpoint_id,
)
from agentenv.storage.template_snapshot import TemplateSnapshot

__all__ = [
    "Checkpoint",
    "LayerRef",
    "SnapshotRepository",
    "TemplateSnapshot",
    "backing_chain",
    "create_overlay",
    "create_overlay_over",
    "new_checkpoint_id",
    "remove_stale_staging",
    "remove_tree",
    "seal_readonly",
]
