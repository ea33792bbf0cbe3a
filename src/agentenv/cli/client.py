"""A small synchronous client of the AgentENV HTTP API, for the CLI.

Its one job beyond httpx: turn every failure (server down, timeout, an HTTP error answer
``{code, message}``) into a ``CliError`` carrying one readable sentence, which main.py prints
as ``error: <message>`` with exit code 1.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import typer

from agentenv import __version__
from agentenv.cli import credentials
from agentenv.cli.context import CliError, globals_of

DEFAULT_TIMEOUT = 30.0
# File transfers: a server that takes or gives no byte for five minutes is stuck (a slow guest
# disk under TCG can hold a write back for many seconds, not minutes).
STREAM_TIMEOUT = httpx.Timeout(DEFAULT_TIMEOUT, read=300.0, write=300.0)
# Command output: the server sends a keepalive line after EXEC_KEEPALIVE_S of silence
# (api/routes/data.py), so a stream silent for four of them is a stuck server or network.
EXEC_TIMEOUT = httpx.Timeout(DEFAULT_TIMEOUT, read=60.0, write=60.0)


class ApiClient:
    def __init__(self, url: str, key: str | None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url.rstrip("/")
        headers = {"User-Agent": f"aenv/{__version__}"}
        if key:
            if not key.isascii():
                raise CliError("the API key is not usable: it must be ASCII (e2b_ and 40 hex digits)")
            headers["X-API-Key"] = key
        try:
            host = urlsplit(self.url).hostname or ""
            # Never send a local server's traffic through an HTTP(S)_PROXY from the environment.
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                      trust_env=host not in ("127.0.0.1", "localhost", "::1"))
        except (ValueError, httpx.InvalidURL) as exc:
            raise CliError(f"the server address {url!r} is not usable: {exc}") from None

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def call(self, method: str, path: str, **kw: Any) -> Any:
        """One request; returns the decoded JSON body (None when there is none)."""
        return self._json(self._send(method, path, **kw))

    def call_pages(self, path: str, params: dict[str, str] | None = None) -> list[Any]:
        """Every item of a list route that pages as E2B's do (``X-Next-Token`` → ``nextToken``)."""
        items: list[Any] = []
        params = dict(params or {})
        while True:
            resp = self._send("GET", path, params=params)
            page = self._json(resp)
            if not isinstance(page, list):
                raise CliError(f"the server at {self.url} answered {path} with {type(page).__name__}, not a list")
            items += page
            if not (token := resp.headers.get("x-next-token")):
                return items
            params["nextToken"] = token

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        with self._translate():
            resp = self._http.request(method, path, **kw)
        raise_for_error(resp)
        return resp

    def _json(self, resp: httpx.Response) -> Any:
        """The body as JSON; an answer that is not JSON says the address is not our server's."""
        if not resp.content:
            return None
        ctype = resp.headers.get("content-type", "")
        if not ctype.startswith("application/json"):
            raise CliError(f"the server at {self.url} answered {ctype or 'an untyped body'}, not JSON: "
                           "is it an AgentENV server? (set the address with --url or `aenv auth`)")
        try:
            return resp.json()
        except ValueError as exc:
            raise CliError(f"the server at {self.url} answered with broken JSON ({exc})") from None

    @contextmanager
    def stream(self, method: str, path: str, **kw: Any) -> Iterator[httpx.Response]:
        """A streamed response, already checked for an error status; errors while the caller
        reads the body are translated too."""
        kw.setdefault("timeout", STREAM_TIMEOUT)
        with self._translate(), self._http.stream(method, path, **kw) as resp:
            if resp.is_error:
                resp.read()
                raise_for_error(resp)
            yield resp

    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            raise CliError(f"cannot reach the AgentENV server at {self.url} ({_reason(exc)}); "
                           "is `aenv serve` running? (set the address with --url or `aenv auth`)") from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"the server at {self.url} did not answer in time ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise CliError(f"request to {self.url} failed: {_reason(exc)}") from exc
        except httpx.InvalidURL as exc:  # a base URL httpx takes but cannot send to
            raise CliError(f"the server address {self.url!r} is not usable: {exc}") from exc


def raise_for_error(resp: httpx.Response) -> None:
    if resp.is_error:
        raise CliError(error_message(resp), status=resp.status_code)


def error_message(resp: httpx.Response) -> str:
    """The server's ``message`` (falling back to the raw body), with a hint for a bad key."""
    try:
        body = resp.json()
        message = str(body.get("message") or body.get("detail") or body) if isinstance(body, dict) else str(body)
    except ValueError:
        message = resp.text.strip()[:300] or f"HTTP {resp.status_code} {resp.reason_phrase}"
    if resp.status_code == 401:
        message += " (run `aenv auth`, or pass --key / set AENV_API_KEY)"
    return message


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return re.sub(r"^\[Errno -?\d+\]\s*", "", text).rstrip(".").lower() if text[0] == "[" else text


def client_for(ctx: typer.Context, *, timeout: float = DEFAULT_TIMEOUT) -> ApiClient:
    """A client for the server the global options / credentials file / defaults point at."""
    g = globals_of(ctx)
    creds = credentials.resolve(g.url, g.key)
    return ApiClient(creds.url, creds.key, timeout=timeout)
