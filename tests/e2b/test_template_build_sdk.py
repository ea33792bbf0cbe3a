"""A template build through the official E2B Python SDK's template builder (2.63), unchanged:
copy + run + env + workdir + user + start command with wait_for_port, then Sandbox.create."""

from __future__ import annotations

import httpx

from tests.e2b.conftest import PY_LATEST, SDK

PROGRAM = """
    import json, os, pathlib, tempfile, time
    from e2b import Sandbox, Template, wait_for_port
    ctx = pathlib.Path(tempfile.mkdtemp())
    (ctx / "app").mkdir()
    (ctx / "app" / "index.html").write_text("hello from the sdk build\\n")
    logs = []
    t = (Template(file_context_path=str(ctx))
         .from_template("base")
         .run_cmd("mkdir -p /srv/web && chown user: /srv/web", user="root")
         .copy("app", "/srv/web/")
         .set_envs({"SDK_VAR": "sdk-value"})
         .set_workdir("/srv/web")
         .set_user("user")
         .run_cmd("echo built-by-$(whoami) > built.txt")
         .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000)))
    t0 = time.monotonic()
    info = Template.build(t, alias="sdk-built", on_build_logs=lambda e: logs.append(e.message))
    o = {"build_s": round(time.monotonic() - t0, 1), "template_id": info.template_id,
         "exists": Template.exists("sdk-built")}
    sb = Sandbox.create("sdk-built", timeout=120)
    r = sb.commands.run("pwd; echo $SDK_VAR; cat built.txt index.html; whoami")
    o["out"] = r.stdout.splitlines()
    o["start_tagged"] = [p.tag for p in sb.commands.list()]
    o["page"] = sb.commands.run("curl -s http://127.0.0.1:8000/index.html").stdout
    sb.kill()
    o["cached_logs"] = [m for m in logs if m.startswith("CACHED")]
    t0 = time.monotonic()
    Template.build(t, alias="sdk-built")  # unchanged: every step from the cache
    o["rebuild_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(o))
"""


def test_template_build_through_the_sdk(sdk: SDK, api: httpx.Client) -> None:
    try:
        out = sdk.python(PY_LATEST, PROGRAM, timeout=900)
    finally:
        api.delete("/templates/sdk-built")
    assert out["template_id"] == "sdk-built" and out["exists"] is True
    assert out["out"] == ["/srv/web", "sdk-value", "built-by-user", "hello from the sdk build", "user"], out
    assert "start" in out["start_tagged"], out
    assert out["page"] == "hello from the sdk build\n"
    assert out["rebuild_s"] < out["build_s"]
    print(f"\nSDK build: {out['build_s']}s, unchanged rebuild: {out['rebuild_s']}s")
