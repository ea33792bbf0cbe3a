"""Template tags, as E2B's ``name:tag`` references and its ``/templates/tags`` routes.

A node keeps one build per template (a rebuild replaces it), so every tag of a template names
its current build: ``default`` always, plus those given to its build (``Template.build(t,
"name:v2")``) or assigned since. A rebuild keeps only the new build's tags, since the build
the old ones named is gone; a reference to one of them is then a 404 that lists the tags the
template has. Image templates (``aenv template pull``) have the ``default`` tag only.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from agentenv.errors import InvalidRequest, NotFound, TemplateNotFound

if TYPE_CHECKING:
    from agentenv.orchestrator.builds.records import TemplateEntry
    from agentenv.orchestrator.builds.runner import Builds
    from agentenv.orchestrator.templates import TemplateCatalog

DEFAULT = "default"
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class TagNotFound(NotFound):
    def __init__(self, name: str, tag: str, tags: list[str]) -> None:
        super().__init__(f"template '{name}' has no tag '{tag}'; its tags: {', '.join(tags)}")


def resolve(ref: str, builds: Builds, catalog: TemplateCatalog) -> str:
    """``name:tag`` → ``name`` when the template has that tag; any other reference unchanged."""
    name, sep, tag = ref.partition(":")
    if not sep:
        return ref
    if builds.exists(name):
        tags = builds.template(name).tags
    elif catalog.exists(name):
        tags = [DEFAULT]
    else:
        raise TemplateNotFound(ref)
    if tag not in tags:
        raise TagNotFound(name, tag, tags)
    return name


def _checked(tags: list[str]) -> list[str]:
    if not tags or not all(isinstance(t, str) and TAG.fullmatch(t) for t in tags):
        raise InvalidRequest("tags must be a non-empty list of 1-128 letters, digits, '.', '-' or '_', "
                             "starting with a letter or digit")
    return tags


def assign(builds: Builds, target: str, tags: list[str]) -> TemplateEntry:
    """Give the build that ``target`` (``name:tag``, or ``name`` for its default) names the
    ``tags`` too; returns the template's entry."""
    name, _, tag = target.partition(":")
    entry = builds.template(name)
    if (tag or DEFAULT) not in entry.tags:
        raise TagNotFound(name, tag, entry.tags)
    return _save(builds, entry, sorted(set(entry.tags) | set(_checked(tags))))


def remove(builds: Builds, name: str, tags: list[str]) -> TemplateEntry:
    """Take ``tags`` off the template ``name``; ``default`` stays (a plain ``name`` means it)."""
    entry = builds.template(name)
    if DEFAULT in _checked(tags):
        raise InvalidRequest(f"the '{DEFAULT}' tag of template '{name}' cannot be removed: "
                             f"'{name}' without a tag means it")
    if missing := [t for t in tags if t not in entry.tags]:
        raise TagNotFound(name, missing[0], entry.tags)
    return _save(builds, entry, [t for t in entry.tags if t not in tags])


def _save(builds: Builds, entry: TemplateEntry, tags: list[str]) -> TemplateEntry:
    new = replace(entry, tags=tags, updated_at=time.time())
    builds.put_template(new)
    return new
