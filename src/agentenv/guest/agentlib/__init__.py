"""Modules of the guest agent (``agent.py`` is its entry point). Stdlib only: they are copied
into the guest image next to ``agent.py`` and import nothing from the host package."""
