"""The E2B SDK metrics of issue #4 are registered in ``aenv bench`` (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.bench import e2b_sdk
from agentenv.bench.scenarios import SCENARIOS


def test_e2b_metrics_registered() -> None:
    for name in ("e2b_tti_ms", "e2b_tti_burst50_ms", "e2b_exec_rtt_ms", "guest_bash_true_ms",
                 "e2b_exec_server_cpu_ms", "upload_100mb_s", "download_100mb_s"):
        assert name in SCENARIOS
        assert SCENARIOS[name].__module__ == "agentenv.bench.e2b_sdk"
    assert SCENARIOS["e2b_exec_rtt_ms"] is SCENARIOS["guest_bash_true_ms"] is SCENARIOS["e2b_exec_server_cpu_ms"]
    assert SCENARIOS["upload_100mb_s"] is SCENARIOS["download_100mb_s"]


def test_program_compiles() -> None:
    compile(e2b_sdk.PROGRAM, "e2b_bench_program", "exec")


def test_missing_sdk_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(e2b_sdk, "SDK_CACHE", tmp_path)
    with pytest.raises(RuntimeError, match="scripts/sdk-clients"):
        e2b_sdk.sdk_python()
