"""A remote command's end as a local exit status, the shell's way: its code, or 128+N when
signal N killed it (envd reports ``signal: <name>``, with libc's signal names)."""

from __future__ import annotations

import signal


def signal_number(status: str) -> int | None:
    """The signal named by an envd status such as ``signal: segmentation fault``, or None."""
    name = status.removeprefix("signal: ").strip().lower()
    if not status.startswith("signal: ") or not name:
        return None
    for sig in signal.Signals:
        if (signal.strsignal(sig) or "").lower() == name:
            return int(sig)
    return None


def exit_status(exit_code: int | None, status: str) -> int:
    """``exit_code`` (0..255) when the command exited; 128+N for signal N; else 1."""
    if isinstance(exit_code, int) and exit_code >= 0:
        return min(exit_code, 255)
    if (num := signal_number(status)) is not None:
        return 128 + num
    return 1
