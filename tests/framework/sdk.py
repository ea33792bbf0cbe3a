"""What the tests that run official SDK programs share: where the SDK virtualenvs are cached
(scripts/sdk-clients installs them) and the launcher every program runs under."""

from __future__ import annotations

import os
from pathlib import Path

SDK_CACHE = Path(os.environ.get("AENV_SDK_CACHE", "/var/lib/agentenv/cache/sdk-venvs"))

# The program runs under a launcher that leaves with os._exit once it is done: the SDKs' async
# machinery sometimes aborts CPython's interpreter finalization ("PyGILState_Release ...
# finalizing", exit -6) after all its work and output. An exception in the program still exits
# 1 with its traceback.
LAUNCHER = """\
import os, runpy, sys, traceback
try:
    runpy.run_path(sys.argv[1], run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
except BaseException:
    traceback.print_exc()
    code = 1
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""
