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


TAGS = """
    import json
    from e2b import Sandbox, Template
    from e2b.exceptions import NotFoundException, TemplateException, SandboxException
    o = {}
    t = Template().from_template("base").run_cmd("echo tagged > /home/user/t.txt")
    info = Template.build(t, name="sdk-tagged:v1")

    def starts(ref, cmd="cat /home/user/t.txt"):
        try:
            sb = Sandbox.create(ref, timeout=60)
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc)[:200]
        try:
            return sb.commands.run(cmd).stdout.strip()
        finally:
            sb.kill()

    o["v1"], o["default"], o["plain"] = starts("sdk-tagged:v1"), starts("sdk-tagged:default"), starts("sdk-tagged")
    o["nope"] = starts("sdk-tagged:nope")
    assigned = Template.assign_tags("sdk-tagged:v1", ["prod", "stable"])
    o["assigned"] = sorted(assigned.tags)
    o["assigned_build_is_v1s"] = assigned.build_id == {t.tag: t.build_id for t in Template.get_tags("sdk-tagged")}["v1"]
    o["prod"] = starts("sdk-tagged:prod")
    o["listed"] = sorted(t.tag for t in Template.get_tags("sdk-tagged"))
    Template.remove_tags("sdk-tagged", "prod")
    o["after_remove"] = sorted(t.tag for t in Template.get_tags("sdk-tagged"))
    o["prod_removed"] = starts("sdk-tagged:prod")
    try:
        Template.assign_tags("sdk-tagged:nope", ["x"])
        o["assign_unknown"] = "no error"
    except Exception as exc:
        o["assign_unknown"] = type(exc).__name__
    o["base_default"] = starts("base:default", "echo up")
    # a build from a tagged template
    d = Template().from_template("sdk-tagged:stable").run_cmd("cp /home/user/t.txt /home/user/u.txt")
    Template.build(d, name="sdk-derived")
    o["derived"] = starts("sdk-derived", "cat /home/user/u.txt")
    try:
        Template.build(Template().from_template("sdk-tagged:nope").run_cmd("true"), name="sdk-derived2")
        o["derived_unknown_tag"] = "no error"
    except Exception as exc:
        o["derived_unknown_tag"] = type(exc).__name__ + ": " + str(exc)[:300]
    print(json.dumps(o))
"""


def test_template_tags_through_the_sdk(sdk: SDK, api: httpx.Client) -> None:
    """``name:tag`` on create, and ``Template.assign_tags`` / ``remove_tags`` / ``get_tags``."""
    try:
        out = sdk.python(PY_LATEST, TAGS, timeout=900)
    finally:
        for t in ("sdk-derived2", "sdk-derived", "sdk-tagged"):
            api.delete(f"/templates/{t}")
    assert (out["v1"], out["default"], out["plain"], out["prod"]) == ("tagged",) * 4, out
    assert "has no tag 'nope'" in out["nope"] and "default, v1" in out["nope"], out
    assert out["assigned"] == ["prod", "stable"] and out["assigned_build_is_v1s"], out
    assert out["listed"] == ["default", "prod", "stable", "v1"], out
    assert out["after_remove"] == ["default", "stable", "v1"], out
    assert "has no tag 'prod'" in out["prod_removed"], out
    assert out["assign_unknown"] != "no error", out
    assert out["base_default"] == "up", out  # a built-in template has the default tag
    assert out["derived"] == "tagged", out  # fromTemplate "name:tag"
    assert "has no tag 'nope'" in out["derived_unknown_tag"], out
