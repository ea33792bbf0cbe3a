"""Admission by host memory: the reserve, what a new sandbox is counted at, and the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.orchestrator import capacity


def _meminfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available_kb: int) -> None:
    f = tmp_path / "meminfo"
    f.write_text(f"MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   {available_kb} kB\n")
    monkeypatch.setattr(capacity, "MEMINFO", f)


def test_sandboxes_that_fit_above_the_reserve_are_admitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _meminfo(tmp_path, monkeypatch, 2048 * 1024)
    assert capacity.mem_available_mb() == 2048
    assert capacity.memory_shortfall(1024, 16) is None  # 16 x 64 MiB = 1024: exactly the room left


def test_one_more_than_fits_is_refused_with_the_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _meminfo(tmp_path, monkeypatch, 2048 * 1024)
    why = capacity.memory_shortfall(1024, 17)
    assert why is not None
    assert "2048 MiB" in why and "1024 MiB free" in why and "AENV_MEM_RESERVE_MB" in why and "1088 MiB" in why


def test_an_unreadable_meminfo_does_not_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "MEMINFO", tmp_path / "missing")
    assert capacity.memory_shortfall(1024, 1) is None
