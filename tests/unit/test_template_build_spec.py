"""Build spec validation, cache keys, and the `aenv template build` file parser."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from agentenv.cli.dockerfile import BuildFileError, files_hash, parse, tar_gz
from agentenv.errors import InvalidRequest
from agentenv.orchestrator.builds.spec import Config, parse_spec, split_name

H = "a" * 64


def test_parse_spec_accepts_what_the_e2b_sdk_sends() -> None:
    spec = parse_spec({
        "fromTemplate": "base", "force": False, "startCmd": "python3 -m http.server", "readyCmd": "true",
        "steps": [
            {"type": "RUN", "args": ["echo hi", "root"], "force": False},
            {"type": "ENV", "args": ["A", "1", "B", "two words"], "force": False},
            {"type": "WORKDIR", "args": ["/app"], "force": False},
            {"type": "USER", "args": ["user"], "force": False},
            {"type": "COPY", "args": ["src", "/app/", "", ""], "filesHash": H, "force": False, "forceUpload": None},
        ]})
    assert [s.type for s in spec.steps] == ["RUN", "ENV", "WORKDIR", "USER", "COPY"]
    assert spec.steps[4].files_hash == H
    assert spec.configs()[-1] == Config(env={"A": "1", "B": "two words"}, workdir="/app", user="user")


def test_e2b_default_base_image_is_our_base_template() -> None:
    spec = parse_spec({"fromImage": "e2bdev/base:latest", "steps": []})
    assert spec.from_template == "base" and spec.from_image is None


@pytest.mark.parametrize(("body", "words"), [
    ({"steps": []}, "fromTemplate"),
    ({"fromTemplate": "base", "fromImage": "x:1", "steps": []}, "either"),
    ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["ok"]}, {"type": "NOPE", "args": []}]},
     "steps[1] (step 2"),
    ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["K"]}]}, "even number"),
    ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["1K", "v"]}]}, "not a valid environment"),
    ({"fromTemplate": "base", "steps": [{"type": "RUN", "args": [""]}]}, "non-empty command"),
    ({"fromTemplate": "base", "steps": [{"type": "USER", "args": ["bad user"]}]}, "user name"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "/b"]}]}, "filesHash is required"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": H}]}, "inside"),
    ({"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "/b", "", "999"], "filesHash": H}]},
     "octal"),
    ({"fromImage": "x:1", "fromImageRegistry": {"type": "aws"}, "steps": []}, "only {type: registry"),
    ({"fromTemplate": "base", "steps": [], "readyTimeout": -1}, "readyTimeout"),
])
def test_parse_spec_refuses_naming_the_problem(body: dict, words: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_spec(body)
    assert words in exc.value.message


def test_cache_keys_chain_over_base_and_every_step_but_not_force() -> None:
    def steps(last: str, force: bool = False) -> list[dict]:
        return [{"type": "RUN", "args": ["a"]}, {"type": "ENV", "args": ["K", "v"]},
                {"type": "RUN", "args": [last], "force": force}]

    a = parse_spec({"fromTemplate": "base", "steps": steps("x")}).cache_keys({"snap": 1})
    b = parse_spec({"fromTemplate": "base", "steps": steps("y")}).cache_keys({"snap": 1})
    c = parse_spec({"fromTemplate": "base", "steps": steps("x", True)}).cache_keys({"snap": 1})
    d = parse_spec({"fromTemplate": "base", "steps": steps("x")}).cache_keys({"snap": 2})
    assert a[:2] == b[:2] and a[2] != b[2]
    assert a == c
    assert not set(a) & set(d)
    e = parse_spec({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["a"]},
                                                       {"type": "ENV", "args": ["K", "other"]},
                                                       {"type": "RUN", "args": ["x"]}]}).cache_keys({"snap": 1})
    assert e[0] == a[0] and e[2] != a[2], "an ENV change invalidates the next RUN"


def test_force_invalidates_from_its_step() -> None:
    s = parse_spec({"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["a"]},
                                                       {"type": "RUN", "args": ["b"], "force": True},
                                                       {"type": "RUN", "args": ["c"]}]})
    assert s.reusable_until() == 1
    assert parse_spec({"fromTemplate": "base", "force": True, "steps": []}).reusable_until() == 0


def test_relative_workdir_resolves_against_the_previous_one() -> None:
    s = parse_spec({"fromTemplate": "base", "steps": [{"type": "WORKDIR", "args": ["/a"]},
                                                       {"type": "WORKDIR", "args": ["b/../c"]}]})
    assert s.configs()[-1].workdir == "/a/c"


def test_split_name() -> None:
    assert split_name("my-app:v1") == ("my-app", ["v1"])
    with pytest.raises(InvalidRequest):
        split_name("bad name")


BUILD_FILE = r"""
# a comment
FROM base
ENV A=1 B="two words"
ENV PATHX /opt/x bin
RUN apt-get update && \
    # a comment inside
    echo done
RUN --user=root id
WORKDIR /app
USER user
COPY --chown=user:user --chmod=0755 a.txt sub /app/
START_CMD ["python3", "-m", "http.server", "8000"]
READY_CMD curl -sf http://127.0.0.1:8000/
"""


def test_build_file_parses_into_e2b_steps() -> None:
    bf = parse(BUILD_FILE)
    b = bf.body
    assert b["fromTemplate"] == "base"
    assert b["steps"][0] == {"type": "ENV", "args": ["A", "1", "B", "two words"]}
    assert b["steps"][1] == {"type": "ENV", "args": ["PATHX", "/opt/x bin"]}
    assert b["steps"][2] == {"type": "RUN", "args": ["apt-get update &&      echo done"]}
    assert b["steps"][3] == {"type": "RUN", "args": ["id", "root"]}
    assert b["steps"][4:6] == [{"type": "WORKDIR", "args": ["/app"]}, {"type": "USER", "args": ["user"]}]
    assert b["steps"][6] == {"type": "COPY", "args": ["a.txt", "/app/", "user:user", "0755"]}
    assert b["steps"][7]["args"][0] == "sub"
    assert [c.step for c in bf.copies] == [6, 7]
    assert b["startCmd"] == "python3 -m http.server 8000"
    assert b["readyCmd"] == "curl -sf http://127.0.0.1:8000/"
    assert parse("FROM python:3.12\nRUN true").body["fromImage"] == "python:3.12"
    # what the parser produces is what the server accepts (filesHash added by the CLI)
    for c in bf.copies:
        b["steps"][c.step]["filesHash"] = H
    parse_spec(b)


@pytest.mark.parametrize(("text", "words"), [
    ("RUN true", "must start with FROM"),
    ("FROM base\nFROM other", "only one FROM"),
    ("FROM base\nRUN", "needs an argument"),
    ("FROM base\nCOPY onlyone", "source and a destination"),
    ("FROM base\nCOPY ../x /y", "inside the context"),
    ("FROM base\nADD x /y", "ADD is not supported"),
    ("FROM base\nEXPOSE 80", "not supported"),
    ("FROM base\nFOO x", "unknown instruction"),
    ("FROM base\nRUN --weird=1 x", "unknown flag"),
    ("FROM base\nCOPY --chmod=99 a /b", "octal"),
    ("# only a comment", "no FROM"),
])
def test_build_file_errors_name_the_line(text: str, words: str) -> None:
    with pytest.raises(BuildFileError) as exc:
        parse(text)
    assert words in str(exc.value)


def test_copy_upload_is_a_tar_relative_to_the_context_and_its_hash_follows_content(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "sub" / "deep" / "f.txt").write_text("one")
    (tmp_path / "a.txt").write_text("a")
    def names(src: str) -> list[str]:
        buf = io.BytesIO()
        tar_gz(tmp_path, src, buf)
        buf.seek(0)
        with tarfile.open(fileobj=buf, mode="r:gz") as t:
            return t.getnames()

    assert names("sub") == ["sub", "sub/deep", "sub/deep/f.txt"]
    assert names("*.txt") == ["a.txt"]
    h1 = files_hash(tmp_path, "sub", "/app/")
    assert files_hash(tmp_path, "sub", "/app/") == h1
    (tmp_path / "sub" / "deep" / "f.txt").write_text("two")
    assert files_hash(tmp_path, "sub", "/app/") != h1
    with pytest.raises(BuildFileError):
        files_hash(tmp_path, "missing", "/x")


def test_a_long_build_log_keeps_the_offsets_the_sdk_polls_by() -> None:
    """The SDKs read the log by absolute offset. Dropping entries from the front past the cap
    shifted every offset: a client skipped lines, the final "Build finished" among them. Now
    the log stops growing at the cap (once noted) and still takes the outcome's lines."""
    from types import SimpleNamespace

    from agentenv.orchestrator.builds.records import BuildRecord
    from agentenv.orchestrator.builds.runner import (
        LOG_TRUNCATED,
        MAX_LOG_ENTRIES,
        Builds,
    )

    runner = SimpleNamespace(_saved_at={}, _save=lambda b: None, _truncated=set())  # the log's bookkeeping only
    b = BuildRecord(build_id="b1", template_id="t")
    received: list[str] = []
    for i in range(MAX_LOG_ENTRIES + 10_000):
        Builds._log(runner, b, f"line {i}", step="1")  # type: ignore[arg-type]
        if i % 997 == 0:  # a client polling as it goes
            received += [e.message for e in Builds.entries(b, len(received), 1000)]
    Builds._log(runner, b, "Build finished", step="finalize")  # type: ignore[arg-type]
    while batch := [e.message for e in Builds.entries(b, len(received), 1000)]:
        received += batch
    assert received[:MAX_LOG_ENTRIES] == [f"line {i}" for i in range(MAX_LOG_ENTRIES)]
    assert received[MAX_LOG_ENTRIES:] == [LOG_TRUNCATED, "Build finished"]


def test_build_output_lines_are_bounded_and_split_as_written() -> None:
    """A step's output becomes log lines however it is chunked; a line without a newline is
    logged in pieces of MAX_LOG_LINE, so a step writing one endless line does not hold it
    all in the server's memory."""
    from agentenv.orchestrator.builds.steps import MAX_LOG_LINE, _lines, _pieces

    buf = bytearray()
    assert _lines(buf, b"a\r\nb") == ["a"] and buf == b"b"
    assert _lines(buf, b"c\n\nd\n") == ["bc", "", "d"] and buf == b""
    chunk = b"x" * 65536
    pieces = [line for _ in range(800) for line in _lines(buf, chunk)]  # 50 MiB, no newline
    assert len(buf) < MAX_LOG_LINE and all(len(p) == MAX_LOG_LINE for p in pieces)
    assert len(pieces) * MAX_LOG_LINE + len(buf) == 800 * 65536
    assert _pieces(bytearray(b"tail"), final=True) == ["tail"]
