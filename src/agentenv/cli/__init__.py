"""The `aenv` command line: a thin client of the HTTP API plus host setup (serve/setup/doctor).

Client commands import nothing of the server side (fastapi, orchestrator) so they start fast;
only `aenv serve` imports ``agentenv.server``, inside the command.
"""
