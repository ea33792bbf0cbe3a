"""Sandbox lifecycle: the states and the transitions allowed between them.

    creating ──▶ running ◀──────────────┐
        │         │  │  │               │
        │         │  │  ├─▶ snapshotting┤   brief stop; the sandbox keeps running
        │         │  │  └─▶ forking ────┘
        │         │  └─▶ pausing ──▶ paused ──▶ resuming ──▶ running
        │         │         │                      │
        └─▶ error ◀─────────┴──────────────────────┘   (pausing / resuming fall back:
                  │                                      see Orchestrator.pause / resume)
                  └─▶ killing ──▶ (row deleted)          killing is reachable from every
                                                         stable state

Every state change goes through ``Orchestrator._transition``, which checks this table,
persists the new state and logs it. Operations take the sandbox's lock, so a second
operation on a sandbox in a transitional state waits for the first to finish, then sees
the state it left.
"""

from __future__ import annotations

from enum import Enum

from agentenv.errors import (
    RequestError,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)


class State(str, Enum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"
    ERROR = "error"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.CREATING: frozenset({State.RUNNING, State.ERROR, State.KILLING}),
    State.RUNNING: frozenset({State.KILLING, State.ERROR, State.PAUSING, State.SNAPSHOTTING, State.FORKING}),
    State.PAUSING: frozenset({State.PAUSED, State.RUNNING, State.ERROR}),
    State.PAUSED: frozenset({State.RESUMING, State.KILLING}),
    State.RESUMING: frozenset({State.RUNNING, State.PAUSED, State.ERROR}),
    State.SNAPSHOTTING: frozenset({State.RUNNING, State.ERROR}),
    State.FORKING: frozenset({State.RUNNING, State.ERROR}),
    State.ERROR: frozenset({State.KILLING}),
    State.KILLING: frozenset({State.ERROR}),
}

# States in which the sandbox holds a VM (counts against the node's capacity).
ACTIVE = frozenset({State.CREATING, State.RUNNING, State.PAUSING, State.RESUMING,
                    State.SNAPSHOTTING, State.FORKING})


def allowed(src: State, dst: State) -> bool:
    return dst in TRANSITIONS[src]

# The guest runs, or stands still only for a moment (a snapshot or a fork captures it and lets
# it go on with the same agent and address): its ports are served, commands and files reach it,
# and its timeout can be changed. A pause does not count: its VM goes.
GUEST_UP: frozenset[State] = frozenset({State.RUNNING, State.SNAPSHOTTING, State.FORKING})


def api_state(state: State) -> str:
    """What E2B clients see: they know only ``running`` and ``paused``. A sandbox in a brief
    transition reads as the state it is in for the user (a sandbox being snapshotted keeps
    running); ``creating``, ``killing`` and ``error`` are shown as they are."""
    if state in (State.PAUSING, State.PAUSED):
        return "paused"
    if state in (State.RUNNING, State.RESUMING, State.SNAPSHOTTING, State.FORKING):
        return "running"
    return state.value


def state_error(sandbox_id: str, state: State, required: str, reason: str | None = None) -> RequestError:
    """Why an operation cannot run on a sandbox in ``state``: one that failed or is being
    killed is gone for the caller (404: the E2B SDKs raise SandboxNotFoundException for it,
    and a pause's 409 would read as "already paused"); any other is a conflict (409)."""
    if state == State.ERROR:
        return SandboxFailed(sandbox_id, reason)
    if state == State.KILLING:
        return SandboxNotFound(sandbox_id)
    return SandboxStateError(sandbox_id, state.value, required)
