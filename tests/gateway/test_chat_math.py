"""KaTeX, vendored for the chat page: served with content-hashed names, and loaded by that page alone.

The typesetting itself (formulas, code blocks left alone, a malformed formula kept as text, no
CSP violation) is checked in a browser in tests/browser/test_chat_math.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client, override_settings

import llmgw.settings as project_settings
from apps.accounts.models import User
from tests.builders import make_node
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db

KATEX = Path(project_settings.BASE_DIR) / "llmgw" / "console" / "static" / "console" / "katex"
HASHED = r"/static/console/katex/{stem}\.min\.[0-9a-f]{{12}}\.{suffix}"


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The static files as `llmgw up` collects them, with the project's own storage."""
    root = tmp_path_factory.mktemp("static")
    with override_settings(STORAGES=project_settings.STORAGES, STATIC_ROOT=root):
        call_command("collectstatic", interactive=False, verbosity=0)
    return root


@pytest.fixture
def hashed(settings: Any, collected: Path) -> Iterator[Path]:
    settings.STORAGES = project_settings.STORAGES
    settings.STATIC_ROOT = collected
    yield collected


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_project_stores_static_files_under_content_hashed_names() -> None:
    backend = project_settings.STORAGES["staticfiles"]["BACKEND"]
    assert backend == "whitenoise.storage.CompressedManifestStaticFilesStorage"


def test_the_chat_page_loads_katex_by_its_hashed_names(alice: User, hashed: Path) -> None:
    client = signed_in(alice)
    response = client.get("/chat/")
    assert response.status_code == 200
    page = response.content.decode()
    script = re.search(r'<script src="(' + HASHED.format(stem="katex", suffix="js") + r')" defer></script>', page)
    sheet = re.search(r'<link rel="stylesheet" href="(' + HASHED.format(stem="katex", suffix="css") + r')">', page)
    assert script and sheet, page[:2000]
    # KaTeX comes before the chat's script, which uses it (both deferred: they run in this order).
    chat = re.search(r'<script src="/static/console/chat\.[0-9a-f]{12}\.js" defer>', page)
    assert chat and script.start() < chat.start()
    assert re.search(r'href="/static/console/chat\.[0-9a-f]{12}\.css"', page)
    assert "data-t-math-error=" in page
    # The files are there under those names, and served as files that never change.
    for url in (script.group(1), sheet.group(1)):
        assert (hashed / url.removeprefix("/static/")).is_file()
        served = Client().get(url)
        assert served.status_code == 200, url
        assert "immutable" in served.headers.get("Cache-Control", ""), served.headers
    # The stylesheet names its fonts by their hashed names too, and only woff2 files that exist.
    css = (hashed / sheet.group(1).removeprefix("/static/")).read_text()
    fonts = re.findall(r"url\(\"?([^)\"]+)\"?\)", css)
    assert len(fonts) == 20
    for font in fonts:
        assert re.fullmatch(r"fonts/KaTeX_[A-Za-z0-9_-]+\.[0-9a-f]{12}\.woff2", font), font
        assert (hashed / "console" / "katex" / font).is_file()
    check_body(response, check_strict(response, "/chat/"), "/chat/")


def test_no_other_page_loads_katex(alice: User, hashed: Path) -> None:
    make_node("gpu1", gpus=1)
    client = signed_in(alice)
    for url in ("/", "/account/", "/cluster/", "/nodes/gpu1/", "/docs/clients", "/usage/"):
        response = client.get(url)
        assert response.status_code == 200, url
        page = response.content.decode().lower()
        assert "katex" not in page, url
        assert "console/chat." not in page, url


def test_the_vendored_copy_records_its_version_and_licence() -> None:
    version = re.search(r'version:"(\d+\.\d+\.\d+)"', (KATEX / "katex.min.js").read_text())
    assert version
    readme = (KATEX / "README.txt").read_text()
    assert f"KaTeX {version.group(1)} " in readme and f"katex@{version.group(1)}" in readme
    assert "MIT License" in readme
    assert (KATEX / "LICENSE").read_text().startswith("The MIT License (MIT)")
    # Only what the page uses: the script, the stylesheet and the woff2 fonts.
    kept = sorted(path.relative_to(KATEX).as_posix() for path in KATEX.rglob("*") if path.is_file())
    assert [p for p in kept if not p.startswith("fonts/")] == ["LICENSE", "README.txt", "katex.min.css", "katex.min.js"]
    assert all(p.endswith(".woff2") for p in kept if p.startswith("fonts/"))
