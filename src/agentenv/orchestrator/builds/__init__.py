"""Template builds from steps (E2B's build system v2): see runner.py and
docs/mechanisms/template-builds.md."""

from agentenv.orchestrator.builds import tags
from agentenv.orchestrator.builds.records import BuildRecord, LogEntry, TemplateEntry
from agentenv.orchestrator.builds.runner import BUILD_META, TEMPLATE_KIND, Builds
from agentenv.orchestrator.builds.spec import (
           BuildSpec,
           Config,
           Step,
           parse_spec,
           split_name,
)

__all__ = ["BUILD_META", "TEMPLATE_KIND", "BuildRecord", "BuildSpec", "Builds", "Config", "LogEntry", "Step",
           "TemplateEntry", "parse_spec", "split_name", "tags"]
