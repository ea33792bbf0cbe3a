"""AgentENV: microVM sandboxes for agentic RL, speaking the E2B API.

See docs/architecture.md for the map of packages and the flows between them.
"""

__version__ = "0.1.0"
