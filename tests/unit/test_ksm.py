"""AENV_KSM=on on a host that cannot do it fails with what is missing, and changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.errors import VmmError
from agentenv.vmm import ksm


def test_no_ksm_in_the_kernel_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ksm, "KSM_SYSFS", tmp_path / "no-ksm")
    with pytest.raises(VmmError, match="no KSM"):
        ksm.merge_children()
    assert ksm.stats() is None


def test_stats_read_the_host_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"run": "1", "pages_shared": "10", "pages_sharing": "30", "general_profit": "81920"}.items():
        (tmp_path / name).write_text(value + "\n")
    monkeypatch.setattr(ksm, "KSM_SYSFS", tmp_path)
    assert ksm.stats() == ksm.KsmStats(running=True, pages_shared=10, pages_sharing=30, profit_bytes=81920)
