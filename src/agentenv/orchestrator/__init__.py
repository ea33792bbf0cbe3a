"""The orchestrator: sandbox lifecycle state machine, store, templates and warm pool.

See docs/architecture.md for the flows it sequences.
"""

from agentenv.orchestrator.lifecycle import GUEST_UP, State
from agentenv.orchestrator.service import Orchestrator
from agentenv.orchestrator.store import SandboxRecord
from agentenv.orchestrator.templates import Template, TemplateCatalog

__all__ = ["GUEST_UP", "Orchestrator", "SandboxRecord", "State", "Template", "TemplateCatalog"]
