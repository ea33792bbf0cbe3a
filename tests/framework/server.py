"""The server under test is the same throwaway node ``aenv bench`` uses."""

from agentenv.bench.node import LocalNode as ServerProcess

__all__ = ["ServerProcess"]
