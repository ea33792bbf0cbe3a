#!/usr/bin/env python3
"""One Python kernel of the code-interpreter server: a worker process per context.

Started by ``server.py`` as ``python3 -u kernel.py CMD_FD MSG_FD`` in the context's working
directory. Standard library only; imports nothing from ``agentenv`` (copied into the guest as is).

Protocol (JSON lines):

* commands arrive on ``CMD_FD``: ``{"id": N, "code": str, "env": {str: str}}``;
* messages leave on ``MSG_FD``, each tagged with the command's ``id``:
  ``{"type": "number_of_executions", ...}``, ``{"type": "stdout"|"stderr", "text": ...}`` (every
  write to ``sys.stdout``/``sys.stderr``, unsplit), ``{"type": "result", ...}``,
  ``{"type": "error", ...}`` and finally ``{"type": "done"}``.

Python-level prints travel on the message channel, so they keep their order relative to results.
The process's fds 1 and 2 are pipes read by the server too: output of subprocesses and C code is
captured as well, in best-effort order (the server drains them before each message). SIGINT
interrupts the running cell (``KeyboardInterrupt``) and is ignored while idle; a SIGINT that
arrives while the kernel writes a message is raised right after the write (no torn lines).
"""

from __future__ import annotations

import ast
import asyncio
import base64
import builtins
import inspect
import io
import json
import linecache
import os
import signal
import sys
import threading
import traceback
import types

_MSG_FD = -1
_current_id = 0
_executing = False

# (MIME type, IPython-style repr method, field of the E2B result line)
_REPR_METHODS = (
    ("text/html", "_repr_html_", "html"),
    ("text/markdown", "_repr_markdown_", "markdown"),
    ("image/svg+xml", "_repr_svg_", "svg"),
    ("image/png", "_repr_png_", "png"),
    ("image/jpeg", "_repr_jpeg_", "jpeg"),
    ("application/pdf", "_repr_pdf_", "pdf"),
    ("text/latex", "_repr_latex_", "latex"),
    ("application/json", "_repr_json_", "json"),
    ("application/javascript", "_repr_javascript_", "javascript"),
)
_MIME_FIELDS = {mime: field for mime, _, field in _REPR_METHODS}
_MIME_FIELDS.update({"text/plain": "text", "e2b/data": "data", "e2b/chart": "chart"})
_BINARY_FIELDS = {"png", "jpeg", "pdf"}


_MSG_LOCK = threading.Lock()
_main_in_send = 0  # >0 while the main thread writes a message: SIGINT then waits (no torn lines)
_pending_interrupt = False


def _flush_std() -> None:
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _send(msg: dict) -> None:
    global _main_in_send, _pending_interrupt
    msg["id"] = _current_id
    data = (json.dumps(msg, default=str) + "\n").encode()
    main = threading.current_thread() is threading.main_thread()
    if main:
        _main_in_send += 1
    try:
        with _MSG_LOCK:
            while data:
                data = data[os.write(_MSG_FD, data):]
    finally:
        if main:
            _main_in_send -= 1
    if main and _pending_interrupt and _main_in_send == 0:
        _pending_interrupt = False
        if _executing:
            raise KeyboardInterrupt


class _OutStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` of the cells: every write becomes a message on the ordered
    message channel (the server joins them into lines). ``fileno()`` is still the real fd 1/2,
    whose pipe carries what subprocesses and C code write."""

    def __init__(self, kind: str, fd: int) -> None:
        super().__init__()
        self.kind = kind
        self._fd = fd

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "backslashreplace"

    @property
    def buffer(self) -> object:
        return (sys.__stdout__ if self._fd == 1 else sys.__stderr__).buffer  # type: ignore[union-attr]

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if s:
            _flush_std()
            _send({"type": self.kind, "text": s})
        return len(s)


def _put(bundle: dict, mime: str, data: object) -> None:
    field = _MIME_FIELDS.get(mime)
    if isinstance(data, (bytes, bytearray)):
        data = base64.b64encode(bytes(data)).decode("ascii")
    if field is None:
        bundle.setdefault("extra", {})[mime] = data
    elif field not in bundle:
        bundle[field] = data


def _mime_bundle(obj: object) -> dict:
    """The formats Jupyter would show for ``obj``: ``text`` (repr) plus what its ``_repr_*_``
    methods (or ``_repr_mimebundle_``) produce. Methods that fail or return None are skipped."""
    bundle: dict = {}
    if not inspect.isclass(obj):
        method = getattr(obj, "_repr_mimebundle_", None)
        if callable(method):
            try:
                data = method(include=None, exclude=None)
                if isinstance(data, tuple):
                    data = data[0]
                for mime, value in (data or {}).items():
                    _put(bundle, mime, value)
            except Exception:
                pass
        for mime, name, field in _REPR_METHODS:
            method = getattr(obj, name, None)
            if field in bundle or not callable(method):
                continue
            try:
                data = method()
            except Exception:
                continue
            if isinstance(data, tuple):
                data = data[0]
            if data is not None:
                _put(bundle, mime, data)
        if "png" not in bundle and _is_matplotlib_figure(obj):
            _put(bundle, "image/png", _figure_png(obj))
    if "text" not in bundle:
        try:
            bundle["text"] = repr(obj)
        except Exception as exc:  # a broken __repr__ must not kill the cell's other output
            bundle["text"] = f"<repr failed: {type(exc).__name__}: {exc}>"
    return bundle


def _is_matplotlib_figure(obj: object) -> bool:
    return type(obj).__module__ == "matplotlib.figure" and hasattr(obj, "savefig")


def _figure_png(fig: object) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")  # type: ignore[attr-defined]
    return buf.getvalue()


def display(*objs: object, **_kw: object) -> None:
    """Show objects as display data (``is_main_result: false``), like IPython's ``display``."""
    for obj in objs:
        _send({"type": "result", "is_main_result": False, **_mime_bundle(obj)})


def _show_open_figures() -> None:
    """Like Jupyter's inline backend: figures still open after a cell are displayed and closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        for num in plt.get_fignums():
            display(plt.figure(num))
        plt.close("all")
    except Exception:
        pass


def _user_traceback(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # drop the kernel's own frames
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip("\n")


class Kernel:
    def __init__(self) -> None:
        self.count = 0
        self.module = types.ModuleType("__main__")
        self.module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.module  # pickling of classes defined in cells works
        self.ns = self.module.__dict__
        self.loop = asyncio.new_event_loop()
        builtins.display = display  # type: ignore[attr-defined]

    def _run(self, code: types.CodeType) -> object:
        value = eval(code, self.ns)
        if code.co_flags & inspect.CO_COROUTINE:  # top-level await
            value = self.loop.run_until_complete(value)
        return value

    def execute(self, source: str, env: dict[str, str]) -> None:
        global _executing, _pending_interrupt
        _pending_interrupt = False
        self.count += 1
        _send({"type": "number_of_executions", "execution_count": self.count})
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        saved = {k: os.environ.get(k) for k in env}
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        try:
            _executing = True
            os.environ.update(env)
            tree = ast.parse(source, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
                last = ast.Expression(tree.body.pop().value)
            if tree.body:
                self._run(compile(tree, filename, "exec", flags=flags))
            if last is not None:
                value = self._run(compile(last, filename, "eval", flags=flags))
                if value is not None:
                    self.ns["_"] = value
                    _executing = False  # formatting is not interruptible: no half-sent results
                    _send({"type": "result", "is_main_result": True, **_mime_bundle(value)})
            _executing = False
            _show_open_figures()
        except BaseException as exc:  # noqa: B902 - KeyboardInterrupt and SystemExit are cell errors too
            _executing = False
            _send({"type": "error", "name": type(exc).__name__, "value": str(exc),
                   "traceback": _user_traceback(exc)})
        finally:
            _executing = False
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _on_sigint(_signum: int, _frame: object) -> None:
    global _pending_interrupt
    if not _executing:
        return
    if _main_in_send:
        _pending_interrupt = True  # raised once the message is whole
        return
    raise KeyboardInterrupt


def main() -> None:
    global _MSG_FD, _current_id
    cmd_fd, _MSG_FD = int(sys.argv[1]), int(sys.argv[2])
    commands = os.fdopen(cmd_fd, "rb")
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            stream.reconfigure(encoding="utf-8", errors="backslashreplace", write_through=True)  # type: ignore[union-attr]
        except Exception:
            pass
    sys.stdout = _OutStream("stdout", 1)
    sys.stderr = _OutStream("stderr", 2)
    os.environ.setdefault("MPLBACKEND", "Agg")
    signal.signal(signal.SIGINT, _on_sigint)
    sys.argv = [""]
    del sys.path[0]  # the kernel's own directory is not the user's
    sys.path.insert(0, "")
    kernel = Kernel()
    _send({"type": "ready"})  # id 0: the server waits for it only at start-up
    for line in commands:
        try:
            cmd = json.loads(line)
            _current_id = cmd["id"]
            kernel.execute(cmd["code"], cmd.get("env") or {})
            _send({"type": "done"})
        except KeyboardInterrupt:  # arrived between cells: the server still waits for "done"
            _send({"type": "done"})


if __name__ == "__main__":
    main()
