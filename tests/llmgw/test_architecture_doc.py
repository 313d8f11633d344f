"""The code map (docs/architecture.md and its Turkish page) names exactly the apps that are installed:
an app added to INSTALLED_APPS without a section there fails here, and so does a section left for
an app that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings

DOCS = Path(__file__).resolve().parents[2] / "docs"
# An app's section: a heading that names it in code, "### `apps.cluster`".
APP_HEADING = re.compile(r"^#{2,4} `(apps\.[a-z_]+)`\s*$", re.MULTILINE)


def installed_apps() -> set[str]:
    return {name for name in settings.INSTALLED_APPS if name.startswith("apps.")}


@pytest.mark.parametrize("page", ["architecture.md", "tr/architecture.md"])
def test_the_code_map_has_a_section_for_every_installed_app_and_no_other(page: str) -> None:
    headings = APP_HEADING.findall((DOCS / page).read_text(encoding="utf-8"))
    assert len(headings) == len(set(headings)), f"{page}: an app has two sections"
    assert set(headings) == installed_apps(), page


def test_the_code_map_lists_the_apps_in_the_same_order_in_both_languages() -> None:
    english = APP_HEADING.findall((DOCS / "architecture.md").read_text(encoding="utf-8"))
    turkish = APP_HEADING.findall((DOCS / "tr" / "architecture.md").read_text(encoding="utf-8"))
    assert english == turkish
