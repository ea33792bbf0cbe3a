"""CLI tests of the saved-state commands: pause, resume, snapshot create|ls|rm, fork, and the
states `aenv ls` shows. They run against the in-memory server of conftest.py (``states``),
which answers like the real routes, so each test checks what a user sees: stdout, the one
``error:`` line on stderr, and the exit code.
"""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture
def cli(aenv, stub, states):
    """``cli(*args)``: aenv against the in-memory server."""
    return lambda *args, **kw: aenv("--url", stub.url, *args, **kw)


def _not_json(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)


# --- pause / resume -----------------------------------------------------------------------------

def test_pause_then_resume(cli, stub, states):
    sid = states.add()
    res = cli("pause", sid)
    assert res.exit_code == 0, res.output
    assert res.stdout == ""
    assert res.stderr == f"sandbox {sid} paused; `aenv resume {sid}` resumes it\n"
    assert stub.calls("POST", f"/sandboxes/{sid}/pause")[0].json() == {}
    assert states.sandboxes[sid]["state"] == "paused"

    res = cli("resume", sid, "--timeout", "600")
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{sid}\n"
    assert stub.calls("POST", f"/sandboxes/{sid}/resume")[-1].json() == {"timeout": 600}
    assert states.sandboxes[sid]["state"] == "running"


def test_filesystem_only_pause_and_reboot_flags(cli, stub, states):
    sid = states.add()
    assert cli("pause", sid, "--filesystem-only").exit_code == 0
    assert stub.calls("POST", f"/sandboxes/{sid}/pause")[0].json() == {"memory": False}
    res = cli("resume", sid, "--reboot")
    assert res.exit_code == 0, res.output
    assert stub.calls("POST", f"/sandboxes/{sid}/resume")[-1].json() == {"memory": False}
    res = cli("snapshot", sid, "--filesystem-only", "--name", "disk-only")
    assert res.exit_code == 0, res.output
    assert stub.calls("POST", f"/sandboxes/{sid}/snapshots")[-1].json() == {"name": "disk-only", "memory": False}


def test_resume_json_and_default_body(cli, stub, states):
    sid = states.add(state="paused")
    res = cli("resume", sid, "-o", "json")
    assert res.exit_code == 0, res.output
    sandbox = json.loads(res.stdout)
    assert sandbox["sandboxID"] == sid and sandbox["templateID"] == "base" and sandbox["envdAccessToken"]
    assert stub.calls("POST", f"/sandboxes/{sid}/resume")[-1].json() == {}
    # The global option works too.
    states.sandboxes[sid]["state"] = "paused"
    assert json.loads(cli("-o", "json", "resume", sid).stdout)["sandboxID"] == sid


def test_pause_twice_is_a_conflict(cli, states):
    sid = states.add(state="paused")
    res = cli("pause", sid)
    assert res.exit_code == 1
    assert res.stderr == f"error: sandbox '{sid}' is paused; this operation needs it running\n"
    assert res.stdout == ""


def test_resume_of_a_running_sandbox_is_a_conflict(cli, states):
    sid = states.add()
    res = cli("resume", sid)
    assert res.exit_code == 1
    assert res.stderr == f"error: sandbox '{sid}' is running; this operation needs it paused\n"
    assert res.stdout == ""


@pytest.mark.parametrize("command", [["pause"], ["resume"], ["fork"], ["snapshot"], ["snapshot", "create"]])
def test_unknown_sandbox_is_one_error_line(cli, command):
    res = cli(*command, "nope")
    assert res.exit_code == 1
    assert res.stderr == "error: sandbox 'nope' not found\n"
    assert res.stdout == "" and "Traceback" not in res.output


# --- snapshots ----------------------------------------------------------------------------------

@pytest.mark.parametrize("form", [["snapshot"], ["snapshot", "create"]])
def test_snapshot_prints_the_id_in_both_forms(cli, stub, states, form):
    sid = states.add()
    res = cli(*form, sid)
    assert res.exit_code == 0, res.output
    (snap,) = states.snapshots
    assert res.stdout == f"{snap['snapshotID']}\n"
    assert f"`aenv start {snap['snapshotID']}`" in res.stderr
    assert stub.calls("POST", f"/sandboxes/{sid}/snapshots")[0].json() == {}
    assert states.sandboxes[sid]["state"] == "running"  # a snapshot leaves the sandbox running


@pytest.mark.parametrize("form", [["snapshot"], ["snapshot", "create"]])
def test_snapshot_with_a_name(cli, stub, states, form):
    sid = states.add()
    res = cli(*form, sid, "--name", "warm")
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{states.snapshots[0]['snapshotID']}\n"
    assert "`aenv start warm`" in res.stderr
    assert stub.calls("POST", f"/sandboxes/{sid}/snapshots")[0].json() == {"name": "warm"}


def test_snapshot_options_before_the_id_and_json(cli, states):
    sid = states.add()
    res = cli("snapshot", "--name", "warm", "-o", "json", sid)
    assert res.exit_code == 0, res.output
    snap = json.loads(res.stdout)
    assert snap == states.snapshots[0]
    assert snap["names"] == ["warm"] and snap["sandboxID"] == sid


def test_snapshot_name_taken_and_paused_sandbox(cli, states):
    sid = states.add()
    assert cli("snapshot", sid, "--name", "warm").exit_code == 0
    res = cli("snapshot", sid, "--name", "warm")
    assert res.exit_code == 1
    assert res.stderr == ("error: the name 'warm' is already used by a template or snapshot; "
                          "choose another one\n")
    paused = states.add(state="paused")
    res = cli("snapshot", "create", paused)
    assert res.exit_code == 1
    assert res.stderr == f"error: sandbox '{paused}' is paused; this operation needs it running\n"


def test_snapshot_without_arguments_shows_help(cli):
    res = cli("snapshot")
    assert res.exit_code == 2
    for sub in ("create", "ls", "rm"):
        assert sub in res.stdout


def test_snapshot_ls_table_and_json(cli, stub, states):
    a, b = states.add(), states.add(template="py")
    for args in ([a, "--name", "warm"], [a], [b]):
        assert cli("snapshot", *args).exit_code == 0
    piped = cli("snapshot", "ls")
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.stdout) == states.snapshots

    table = cli("snapshot", "ls", "-o", "table")
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["SNAPSHOT", "NAME", "SANDBOX", "TEMPLATE", "CPU", "MEMORY", "CREATED"]
    assert len(lines) == 4
    first = states.snapshots[0]
    assert lines[1].split()[:6] == [first["snapshotID"], "warm", a, "base", "2", "512"]
    assert lines[3].split()[:4] == [states.snapshots[2]["snapshotID"], b, "py", "2"]  # no name: empty cell
    _not_json(table.stdout)

    only_b = cli("snapshot", "ls", "--sandbox", b)
    assert [s["sandboxID"] for s in json.loads(only_b.stdout)] == [b]
    assert stub.requests[-1].query == {"sandboxID": [b]}
    named = cli("-o", "json", "snapshot", "ls", "--name", "warm")
    assert [s["names"] for s in json.loads(named.stdout)] == [["warm"]]
    assert stub.requests[-1].query == {"name": ["warm"]}


def test_snapshot_ls_empty(cli):
    assert cli("snapshot", "ls", "-o", "table").stdout == "no snapshots\n"
    assert json.loads(cli("snapshot", "ls").stdout) == []


def test_snapshot_rm_by_name_and_id(cli, stub, states):
    sid = states.add()
    cli("snapshot", sid, "--name", "warm")
    cli("snapshot", sid)
    by_id = states.snapshots[1]["snapshotID"]
    res = cli("snapshot", "rm", "warm", by_id)
    assert res.exit_code == 0, res.output
    assert res.stdout == f"warm\n{by_id}\n"
    assert states.snapshots == []
    assert [r.path for r in stub.requests if r.method == "DELETE"] == ["/snapshots/warm", f"/snapshots/{by_id}"]


def test_snapshot_rm_unknown(cli, states):
    sid = states.add()
    cli("snapshot", sid, "--name", "warm")
    res = cli("snapshot", "rm", "nope", "warm")
    assert res.exit_code == 1
    assert res.stderr == "error: snapshot 'nope' not found; `aenv snapshot ls` lists the snapshots\n"
    assert res.stdout == "warm\n"  # the others are still deleted
    assert states.snapshots == []
    assert cli("snapshot", "rm").exit_code == 2  # nothing to delete: usage error


def test_start_from_a_snapshot_name(cli, stub, states):
    sid = states.add()
    cli("snapshot", sid, "--name", "warm")
    res = cli("start", "warm", "-d", "--timeout", "60")
    assert res.exit_code == 0, res.output
    new = res.stdout.strip()
    assert new != sid and states.sandboxes[new]["templateID"] == "warm"
    assert stub.calls("POST", "/sandboxes")[-1].json() == {"templateID": "warm", "timeout": 60}
    res = cli("start", "gone", "-d")
    assert res.exit_code == 1
    assert res.stderr == "error: template 'gone' not found; `aenv template ls` lists the available templates\n"


# --- fork ---------------------------------------------------------------------------------------

def test_fork_json_when_piped(cli, stub, states):
    sid = states.add()
    res = cli("fork", sid, "-n", "3")
    assert res.exit_code == 0, res.output
    items = json.loads(res.stdout)
    assert len(items) == 3 and all(set(i) == {"sandbox"} for i in items)
    children = [i["sandbox"]["sandboxID"] for i in items]
    assert len(set(children) | {sid}) == 4 and all(states.sandboxes[c]["state"] == "running" for c in children)
    assert stub.calls("POST", f"/sandboxes/{sid}/fork")[-1].json() == {"count": 3}
    assert res.stderr == ""


def test_fork_table_and_options(cli, stub, states):
    sid = states.add(template="py")
    res = cli("fork", sid, "--count", "16", "--timeout", "120", "-o", "table")
    assert res.exit_code == 0, res.output
    assert stub.calls("POST", f"/sandboxes/{sid}/fork")[-1].json() == {"count": 16, "timeout": 120}
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["CHILD", "ID", "TEMPLATE", "RESULT"]
    assert len(lines) == 17
    children = [s for s in states.sandboxes if s != sid]
    for n, (line, child) in enumerate(zip(lines[1:], children, strict=True), 1):
        assert line.split() == [str(n), child, "py", "running"]
    assert cli("fork", sid).exit_code == 0  # -n defaults to 1
    assert stub.calls("POST", f"/sandboxes/{sid}/fork")[-1].json() == {"count": 1}


def test_fork_with_failed_children_exits_1(cli, states):
    sid = states.add()
    states.failing_children = {1: (507, "no space left for the memory layer"), 3: (500, "QEMU exited")}
    table = cli("fork", sid, "-n", "4", "-o", "table")
    assert table.exit_code == 1
    assert table.stderr == f"error: 2 of 4 copies of sandbox {sid} failed\n"
    rows = table.stdout.splitlines()[1:]
    assert rows[1].split() == ["2", "-", "-", "error", "507:", "no", "space", "left", "for", "the", "memory", "layer"]
    assert rows[3].split() == ["4", "-", "-", "error", "500:", "QEMU", "exited"]
    assert rows[0].split()[3] == "running" and rows[2].split()[3] == "running"

    piped = cli("fork", sid, "-n", "4")
    assert piped.exit_code == 1
    items = json.loads(piped.stdout)
    assert items[1] == {"error": {"code": 507, "message": "no space left for the memory layer"}}
    assert [("sandbox" in i) for i in items] == [True, False, True, False]
    assert piped.stderr == f"error: 2 of 4 copies of sandbox {sid} failed\n"


def test_fork_count_out_of_range_is_a_usage_error(cli, stub, states):
    """Below 1 the CLI refuses; the maximum is the server's (AENV_MAX_FORK), which it enforces."""
    sid = states.add()
    res = cli("fork", sid, "-n", "0")
    assert res.exit_code == 2
    assert "--count" in res.stderr
    assert stub.calls("POST", f"/sandboxes/{sid}/fork") == []
    res = cli("fork", sid, "-n", "21")
    assert [c.json()["count"] for c in stub.calls("POST", f"/sandboxes/{sid}/fork")] == [21]


def test_fork_of_a_paused_sandbox_is_a_conflict(cli, states):
    sid = states.add(state="paused")
    res = cli("fork", sid, "-n", "2")
    assert res.exit_code == 1
    assert res.stderr == f"error: sandbox '{sid}' is paused; this operation needs it running\n"
    assert res.stdout == ""


# --- ls shows the new states ----------------------------------------------------------------------

NEW_STATES = ["paused", "pausing", "resuming", "snapshotting", "forking"]


def test_ls_shows_saved_state_states(cli, stub, states):
    ids = {state: states.add(state=state) for state in ["running", *NEW_STATES]}
    table = cli("ls", "-o", "table")
    assert table.exit_code == 0, table.output
    rows = {line.split()[0]: line.split()[2] for line in table.stdout.splitlines()[1:]}
    assert rows == {sid: state for state, sid in ids.items()}
    piped = cli("ls", "--state", "paused,forking")
    assert {r["sandboxID"]: r["state"] for r in json.loads(piped.stdout)} == {ids["paused"]: "paused",
                                                                                ids["forking"]: "forking"}
    assert stub.requests[-1].query == {"state": ["paused,forking"]}


def test_a_whole_session(cli, states):
    """start → snapshot → pause → ls → resume → fork → start from the snapshot → rm, as a user would."""
    sid = cli("start", "-d").stdout.strip()
    snap = cli("snapshot", sid, "--name", "ready").stdout.strip()
    assert cli("pause", sid).exit_code == 0
    assert "paused" in cli("ls", "-o", "table").stdout
    assert cli("resume", sid).stdout.strip() == sid
    children = [i["sandbox"]["sandboxID"] for i in json.loads(cli("fork", sid, "-n", "2").stdout)]
    again = cli("start", "ready", "-d").stdout.strip()
    assert [s["snapshotID"] for s in json.loads(cli("snapshot", "ls", "--sandbox", sid).stdout)] == [snap]
    res = cli("rm", "--all")
    assert res.exit_code == 0
    assert sorted(res.stdout.split()) == sorted([sid, *children, again])
    assert cli("snapshot", "rm", "ready").exit_code == 0
    assert json.loads(cli("snapshot", "ls").stdout) == []


def test_stub_connect_route_answers_like_the_server(stub, states):
    """The stub route `aenv connect` relies on answers like the server."""
    running, paused = states.add(), states.add(state="paused")
    with httpx.Client(base_url=stub.url) as http:
        was_running = http.post(f"/sandboxes/{running}/connect", json={"timeout": 60})
        resumed = http.post(f"/sandboxes/{paused}/connect", json={"timeout": 60})
        missing = http.post("/sandboxes/nope/connect", json={})
    assert (was_running.status_code, was_running.json()["sandboxID"]) == (200, running)
    assert (resumed.status_code, resumed.json()["sandboxID"]) == (201, paused)
    assert states.sandboxes[paused]["state"] == "running"
    assert missing.status_code == 404 and missing.json() == {"code": 404, "message": "sandbox 'nope' not found"}
