"""The import direction of docs/architecture.md, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "agentenv"
MECHANISMS = {"vmm", "network", "storage", "images", "envd_client"}
FOUNDATION = {"errors", "config", "proc", "durable"}
UPPER = {"orchestrator", "proxy", "api", "server", "cli", "bench"}


def imports_of(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agentenv."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("agentenv.")}
    return out


def package_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


FILES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_flow_downward(path: Path) -> None:
    pkg = package_of(path)
    deps = imports_of(path) - {pkg}
    if pkg == "guest":
        assert not deps, f"the guest agent must not import the host package: {deps}"
    elif pkg in MECHANISMS:
        bad = deps & (MECHANISMS | UPPER)
        assert not bad, f"mechanism {pkg} imports {bad}: mechanisms take plain values"
    elif pkg in FOUNDATION:
        assert not deps - FOUNDATION, f"foundation module {pkg} imports {deps - FOUNDATION}"
    elif pkg == "orchestrator":
        assert not deps & {"proxy", "api", "server", "cli", "bench"}, deps
    elif pkg == "proxy":
        assert not deps & {"api", "server", "cli", "bench"}, deps
    elif pkg == "api":
        assert not deps & {"server", "cli", "bench"}, deps
    assert "guest" not in deps or pkg == "images", f"{path}: nothing imports the guest agent"


def test_cli_does_not_import_the_server_side_at_module_level() -> None:
    for path in (SRC / "cli").glob("*.py"):
        deps = imports_of(path, top_level_only=True)
        assert not deps & {"server", "orchestrator", "api", "bench"}, (path, deps)
