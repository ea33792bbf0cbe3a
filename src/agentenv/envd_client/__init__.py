"""Host-side client for the guest agent's envd protocol (Connect RPC + plain HTTP routes)."""

from agentenv.envd_client.client import (
    CommandResult,
    EnvdClient,
    EnvdError,
    EnvdUnavailable,
    ProcessEvent,
)

__all__ = ["CommandResult", "EnvdClient", "EnvdError", "EnvdUnavailable", "ProcessEvent"]
