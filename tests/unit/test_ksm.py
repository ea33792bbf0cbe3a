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


def _merge_any(pid: str = "self") -> str:
    stat = Path(f"/proc/{pid}/ksm_stat").read_text()
    return next(line.split(": ", 1)[1] for line in stat.splitlines() if line.startswith("ksm_merge_any"))


def test_the_probe_leaves_its_caller_unmarked() -> None:
    """`aenv doctor` asks whether KSM would work; only a child process gets marked for it."""
    assert ksm.unsupported_reason() is None  # Linux 6.18 with KSM: the hosts the tests run on
    assert _merge_any() == "no"


def test_doctor_says_whether_ksm_is_on_and_possible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentenv.cli import doctor

    off = doctor.check_ksm(False)
    assert off.status == "OK" and off.detail.startswith("off") and "supports it" in off.detail
    on = doctor.check_ksm(True)
    assert on.status == "OK" and on.detail.startswith("on:")
    monkeypatch.setattr(ksm, "KSM_SYSFS", tmp_path / "no-ksm")
    missing = doctor.check_ksm(True)
    assert missing.status == "FAIL" and "no KSM" in missing.detail
    assert doctor.check_ksm(False).status == "OK"  # not asked for: information only
