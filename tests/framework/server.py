"""The server under test is the same throwaway node ``aenv bench`` uses."""

import httpx

from agentenv.bench.node import LocalNode as ServerProcess
from agentenv.orchestrator import State

__all__ = ["ServerProcess", "all_sandboxes"]


def all_sandboxes(api: httpx.Client) -> list[dict]:
    """Every sandbox of the node, whatever its state (a plain list shows running and paused)."""
    r = api.get("/sandboxes", params={"state": ",".join(s.value for s in State)})
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]
