"""Host-side client for the guest agent's envd protocol (Connect RPC + plain HTTP routes)."""

from agentenv.envd_client.client import (
    MAX_MESSAGE_BYTES,
    CommandResult,
    EnvdClient,
    EnvdError,
    EnvdUnavailable,
    ProcessEvent,
)

__all__ = ["CommandResult", "EnvdClient", "EnvdError", "EnvdUnavailable", "MAX_MESSAGE_BYTES", "ProcessEvent"]
