"""Sandbox lifecycle: the states and the transitions allowed between them.

    creating ──▶ running ──▶ killing ──▶ (row deleted)
        │           │
        └──▶ error ◀┘        error: resources freed, reason kept until the sandbox is killed

Every state change goes through ``Orchestrator._transition``, which checks this table,
persists the new state and logs it.
"""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    CREATING = "creating"
    RUNNING = "running"
    KILLING = "killing"
    ERROR = "error"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.CREATING: frozenset({State.RUNNING, State.ERROR, State.KILLING}),
    State.RUNNING: frozenset({State.KILLING, State.ERROR}),
    State.ERROR: frozenset({State.KILLING}),
    State.KILLING: frozenset({State.ERROR}),
}


def allowed(src: State, dst: State) -> bool:
    return dst in TRANSITIONS[src]
