"""The server under test is the same throwaway node ``aenv bench`` uses."""

from agentenv.bench.node import LocalNode as ServerProcess
from agentenv.bench.node import all_sandboxes

__all__ = ["ServerProcess", "all_sandboxes"]
