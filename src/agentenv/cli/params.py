"""Parsing of repeatable ``K=V`` options (--env, --metadata), shared by several commands."""

from __future__ import annotations

import typer


def parse_pairs(values: list[str] | None, option: str) -> dict[str, str]:
    """``["a=1", "b=x=y"]`` → ``{"a": "1", "b": "x=y"}``; a value without ``=`` is a usage error."""
    out: dict[str, str] = {}
    for raw in values or []:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"'{raw}' must be KEY=VALUE", param_hint=option)
        out[key] = value
    return out
