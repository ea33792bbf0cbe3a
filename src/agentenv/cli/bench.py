"""`aenv bench`: measure every lifecycle operation (min / median / p99) with its baseline.

It starts its own throwaway node (free port, temporary data dir, the provisioned images), so
it never disturbs a running server. Imports the benchmark code lazily: `aenv ls` stays fast.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def bench(
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    only: Annotated[str | None, typer.Option("--only", help="comma-separated metric names")] = None,
    runs: Annotated[int, typer.Option("--runs", min=1, help="repetitions per metric")] = 10,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="provisioned images")] = None,
    accel: Annotated[str, typer.Option("--accel", help="auto, kvm or tcg")] = "auto",
) -> None:
    """Run the benchmark and print the figures."""
    from agentenv.bench import run_bench
    from agentenv.bench.node import CACHE

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # A SIGTERM (a timeout, a CI job cancelled) unwinds like Ctrl-C, so the bench node, its
    # VMs and its registry are torn down instead of outliving the command.
    signal.signal(signal.SIGTERM, interrupted)
    wanted = {n.strip() for n in only.split(",") if n.strip()} if only else None
    report = run_bench(wanted, runs, cache_dir or CACHE, accel)
    if as_json or not sys.stdout.isatty():
        print(json.dumps(report))
        return
    table = Table(title=f"aenv bench ({report['accel']}, {runs} runs)")
    for col in ("metric", "min", "median", "p99", "runs"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, m in report["metrics"].items():  # type: ignore[union-attr]
        table.add_row(name, str(m["min"]), str(m["median"]), str(m["p99"]), str(m["runs"]))
    Console().print(table)
