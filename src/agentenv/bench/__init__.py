"""Benchmarks: every lifecycle operation timed over repeated runs, with its baseline in the
same run. ``aenv bench`` is the command; docs/benchmarks.md records the latest figures."""

from agentenv.bench.scenarios import SCENARIOS, run_bench

__all__ = ["SCENARIOS", "run_bench"]
