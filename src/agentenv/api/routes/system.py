"""Health (unauthenticated, for load balancers) and node details (behind the API key: they
name the node's templates and load)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from agentenv import __version__
from agentenv.api.routes import orch_of

router = APIRouter()  # no key
details = APIRouter()  # the API key


@router.get("/health", status_code=204, response_class=Response)
async def health() -> Response:
    return Response(status_code=204)


@details.get("/health/details")
async def health_details(request: Request) -> dict[str, object]:
    """What a operator checks first: the accelerator in use and why, and the load."""
    orch = orch_of(request)
    counts: dict[str, int] = {}
    for r in orch.list():
        counts[r.state.value] = counts.get(r.state.value, 0) + 1
    return {
        "version": __version__,
        "accel": orch.accel.accel,
        "accelReason": orch.accel.reason,
        "accelForced": orch.accel.forced,
        "cpu": orch.snapshots.cpu_model,  # QEMU -cpu of new template snapshots
        "ksm": orch.memory_merging(),  # AENV_KSM: identical pages merged across sandboxes
        "sandboxes": counts,
        "maxSandboxes": orch.settings.max_sandboxes,
        "poolReady": orch.pool.fill_level()[0],
        "poolSize": orch.pool.fill_level()[1],
        # primed sandboxes of hot snapshots (orchestrator/snapshot_shells.py)
        "snapshotShellsReady": orch.snapshot_shells.fill_level()[0],
        "snapshotShellsWanted": orch.snapshot_shells.fill_level()[1],
        "parkedVMs": orch.parked_vms(),  # paused sandboxes whose stopped VM is kept (AENV_PAUSE_LINGER_S)
        "templates": [t.name for t in orch.templates()],
    }
