"""The manual at /docs: every listed document in English and Turkish, links kept in the portal or
sent to the repository, heading anchors, a 404 in the person's language, and sign-in when asked."""

from __future__ import annotations

import re
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from llmgw.console import docs
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LANGUAGES = ("en", "tr")
REPOSITORY = "https://github.com/llmgw/llmgw/blob/main"


def client_in(language: str) -> Client:
    """A visitor who chose `language` with the footer's switcher (the llmgw_language cookie)."""
    client = Client()
    response = client.get(f"/_lang/{language}")
    assert response.status_code == 302
    assert client.cookies["llmgw_language"].value == language
    return client


class Page(HTMLParser):
    """What the tests look at: the article's links and heading ids, the sidebar, the html lang."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.html_lang = ""
        self.article_lang: str | None = None
        self.in_article = False
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.headings: list[dict[str, Any]] = []  # {"tag", "id", "anchors": [hrefs of headerlinks]}
        self.open_heading: dict[str, Any] | None = None
        self.h1 = ""
        self.in_h1 = False
        self.sidebar: dict[str, str] = {}
        self.slug: str | None = None
        self.untranslated = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "html":
            self.html_lang = values.get("lang", "")
        if tag == "article":
            self.in_article = True
            self.article_lang = values.get("lang")
        if "data-untranslated" in values:
            self.untranslated = True
        if tag == "a" and "data-slug" in values:
            self.slug = values["data-slug"]
            self.sidebar[self.slug] = ""
        if not self.in_article:
            return
        if "id" in values:
            self.ids.add(values["id"])
        if tag in ("h1", "h2", "h3", "h4"):
            self.open_heading = {"tag": tag, "id": values.get("id"), "anchors": []}
            self.headings.append(self.open_heading)
            self.in_h1 = tag == "h1"
        if tag == "a":
            href = values.get("href")
            if "headerlink" in values.get("class", "") and self.open_heading is not None:
                self.open_heading["anchors"].append(href)
            elif href is not None:
                self.links.append(href)

    def handle_endtag(self, tag: str) -> None:
        if tag == "article":
            self.in_article = False
        if tag in ("h1", "h2", "h3", "h4"):
            self.open_heading = None
            self.in_h1 = False
        if tag == "a":
            self.slug = None

    def handle_data(self, data: str) -> None:
        if self.in_h1:
            self.h1 += data
        if self.slug is not None:
            self.sidebar[self.slug] += data


def read(response: Any) -> Page:
    page = Page()
    page.feed(response.content.decode())
    page.close()
    page.h1 = page.h1.replace("¶", "").strip()
    page.sidebar = {slug: title.strip() for slug, title in page.sidebar.items()}
    return page


# The list and the files ------------------------------------------------------------------------


def test_every_document_the_sidebar_lists_exists_in_english_and_turkish() -> None:
    manual = docs.manual()
    assert [d.slug for d in manual][:2] == ["quickstart", "install"]
    for document in manual:
        for language in LANGUAGES:
            path = DOCS / (f"{document.slug}.md" if language == "en" else f"{language}/{document.slug}.md")
            assert path.is_file(), path
            first = path.read_text(encoding="utf-8").splitlines()[0]
            assert first == f"# {document.titles[language]}", f"{path}: the first heading is the title in index.yaml"
            assert document.summaries.get(language), (document.slug, language)
    # Nothing written is left out of the list.
    listed = {f"{d.slug}.md" for d in manual}
    assert {p.name for p in DOCS.glob("*.md")} == listed
    assert {p.name for p in (DOCS / "tr").glob("*.md")} == listed


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_document_renders_in_the_persons_language(language: str) -> None:
    client = client_in(language)
    manual = docs.manual()
    for document in manual:
        url = f"/docs/{document.slug}"
        response = client.get(url)
        assert response.status_code == 200, url
        check_body(response, check_strict(response, url), url)
        page = read(response)
        assert page.html_lang == language, url
        assert page.article_lang == language, url
        assert not page.untranslated, url
        assert page.h1 == document.title(language), url
        title = re.search(r"<title>(.*?)</title>", response.content.decode(), re.S)
        assert title and unescape(title.group(1)) == f"{document.title(language)} · llmgw", url
        assert page.sidebar == {d.slug: d.title(language) for d in manual}, url
    index = client.get("/docs/")
    assert index.status_code == 200
    check_body(index, check_strict(index, "/docs/"), "/docs/")
    text = unescape(index.content.decode())
    for document in manual:
        assert document.title(language) in text and document.summary(language) in text


def test_turkish_is_served_when_chosen_and_english_otherwise() -> None:
    anonymous = Client().get("/docs/nodes")
    assert read(anonymous).h1 == "Nodes and agents"
    turkish = client_in("tr")
    page = read(turkish.get("/docs/nodes"))
    assert (page.h1, page.html_lang, page.article_lang) == ("Düğümler ve ajanlar", "tr", "tr")
    # Switching back is honoured too.
    turkish.get("/_lang/en")
    page = read(turkish.get("/docs/nodes"))
    assert (page.h1, page.html_lang) == ("Nodes and agents", "en")


def test_a_document_not_yet_translated_is_shown_in_english_with_a_note(settings: Any, tmp_path: Path) -> None:
    (tmp_path / "tr").mkdir()
    (tmp_path / "index.yaml").write_text(
        "- slug: only\n  title: {en: Only English, tr: Yalnızca İngilizce}\n  summary: {en: One page.}\n",
        encoding="utf-8",
    )
    (tmp_path / "only.md").write_text("# Only English\n\nText.\n", encoding="utf-8")
    settings.DOCS_DIR = tmp_path
    page = read(client_in("tr").get("/docs/only"))
    assert page.untranslated and page.html_lang == "tr" and page.article_lang == "en"
    assert page.h1 == "Only English"
    assert page.sidebar == {"only": "Yalnızca İngilizce"}
    assert not read(client_in("en").get("/docs/only")).untranslated


# Links and anchors -------------------------------------------------------------------------------

SERVER_PATHS = ("/about", "/api/v1/schema", "/api/v1/docs")


@pytest.mark.parametrize("language", LANGUAGES)
def test_links_between_documents_stay_in_the_portal_and_their_anchors_exist(language: str) -> None:
    client = client_in(language)
    slugs = [d.slug for d in docs.manual()]
    pages = {slug: read(client.get(f"/docs/{slug}")) for slug in slugs}
    wrong = []
    portal_links = 0
    for slug, page in pages.items():
        for href in page.links:
            if ".md" in href.split("#")[0]:
                wrong.append(f"{slug}: {href} points at a Markdown file")
            if href.startswith("#"):
                if href[1:] not in page.ids:
                    wrong.append(f"{slug}: {href} is no heading of this page")
            elif href.startswith("/docs/"):
                portal_links += 1
                target, _, fragment = href[len("/docs/") :].partition("#")
                if target not in pages:
                    wrong.append(f"{slug}: {href} is no document")
                elif fragment and fragment not in pages[target].ids:
                    wrong.append(f"{slug}: {href} names no heading of {target}")
            elif href.startswith("/"):
                if href not in SERVER_PATHS:
                    wrong.append(f"{slug}: {href} is a server path the test does not know")
            elif not href.startswith(("https://", "http://")):
                wrong.append(f"{slug}: {href} is a relative link left as it was")
    assert wrong == []
    assert portal_links >= 15
    assert "/docs/install" in pages["quickstart"].links
    assert "/docs/install#1-install-the-code" in pages["nodes"].links or language != "en"
    assert "/docs/install#1-kodu-kurun" in pages["nodes"].links or language != "tr"


@pytest.mark.parametrize("language", LANGUAGES)
def test_links_to_files_outside_the_manual_go_to_the_repository(language: str, settings: Any) -> None:
    links = read(client_in(language).get("/docs/install")).links
    for path in (
        "deploy/llmgw-web.service",
        "deploy/llmgw-agent.service",
        "deploy/llmgw.env.example",
        "deploy/proxy/caddy/Caddyfile",
        "deploy/proxy/nginx/llmgw.conf",
    ):
        assert f"{REPOSITORY}/{path}" in links, path
        assert (ROOT / path).is_file(), path
    settings.REPOSITORY_URL = "https://git.example.com/llm/llmgw/-/blob/stable"
    links = read(client_in(language).get("/docs/install")).links
    assert "https://git.example.com/llm/llmgw/-/blob/stable/deploy/llmgw-web.service" in links


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_heading_has_an_anchor(language: str) -> None:
    client = client_in(language)
    for document in docs.manual():
        page = read(client.get(f"/docs/{document.slug}"))
        assert len(page.headings) > 1, document.slug
        for heading in page.headings:
            assert heading["id"], (document.slug, heading)
            assert heading["anchors"] == [f"#{heading['id']}"], (document.slug, heading)


def test_links_are_rewritten_where_they_point() -> None:
    slugs = frozenset({"clients", "install"})

    def rewrite(href: str, folder: str = "docs") -> str | None:
        return docs.rewrite_link(href, folder=folder, slugs=slugs, repository=REPOSITORY)

    assert rewrite("clients.md") == "/docs/clients"
    assert rewrite("clients.md#x-y") == "/docs/clients#x-y"
    assert rewrite("clients.md", "docs/tr") == "/docs/clients"
    assert rewrite("../clients.md", "docs/tr") == "/docs/clients"
    assert rewrite("../deploy/llmgw-web.service") == f"{REPOSITORY}/deploy/llmgw-web.service"
    assert rewrite("../../deploy/proxy/", "docs/tr") == f"{REPOSITORY}/deploy/proxy/"
    assert rewrite("other.md") == f"{REPOSITORY}/docs/other.md"  # not in the manual: the file itself
    assert rewrite("#here") == "#here"
    assert rewrite("/api/v1/docs") == "/api/v1/docs"
    assert rewrite("https://example.com/a") == "https://example.com/a"
    assert rewrite("mailto:ops@example.com") == "mailto:ops@example.com"
    assert rewrite("javascript:alert(1)") is None
    assert rewrite("data:text/html,x") is None
    assert rewrite("../../../etc/passwd") is None


def test_raw_html_in_the_markdown_is_shown_as_text() -> None:
    rendered = docs.render_markdown(
        '# T\n\n<script>alert(1)</script> <b onclick="x">bold</b>\n\n<div style="color:red">block</div>\n\n'
        "[bad](javascript:alert(1)) `<code>`\n\n```html\n<p>kept as code</p>\n```\n\n| a | b |\n| - | - |\n| 1 | 2 |\n",
        folder="docs",
        slugs=frozenset(),
        repository=REPOSITORY,
    )
    html = rendered.html
    assert "<script" not in html and "<b " not in html and "<div" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;div style=" in html
    assert "javascript:" not in html and "<a>bad</a>" in html
    assert "<code>&lt;code&gt;</code>" in html
    assert "&lt;p&gt;kept as code&lt;/p&gt;" in html
    assert "<table>" in html
    assert re.search(r'<h1 id="t">T<a class="headerlink" href="#t"', html)


# 404 and sign-in ---------------------------------------------------------------------------------


def test_an_unknown_page_is_a_404_in_the_persons_language() -> None:
    english = Client().get("/docs/no-such-page")
    assert english.status_code == 404
    check_body(english, check_strict(english, "404"), "404")
    assert "Page not found" in english.content.decode()
    assert "no-such-page" in english.content.decode()
    assert read(english).sidebar["quickstart"] == "Quickstart"

    turkish = client_in("tr").get("/docs/no-such-page")
    assert turkish.status_code == 404
    page = read(turkish)
    assert page.html_lang == "tr"
    assert "Sayfa bulunamadı" in turkish.content.decode()
    assert page.sidebar["quickstart"] == "Hızlı başlangıç"


def test_a_link_copied_from_the_repository_is_redirected() -> None:
    response = Client().get("/docs/clients.md")
    assert (response.status_code, response["Location"]) == (302, "/docs/clients")


def test_the_manual_is_public_by_default() -> None:
    for url in ("/docs/", "/docs/quickstart", "/about"):
        assert Client().get(url).status_code == 200, url


def test_the_sign_in_setting_sends_strangers_to_sign_in(settings: Any, bob: Any) -> None:
    settings.DOCS_REQUIRE_SIGNIN = True
    for url in ("/docs/", "/docs/quickstart", "/docs/no-such-page"):
        response = Client().get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/login/?next=/docs/"), url
    client = Client()
    client.force_login(bob)
    assert client.get("/docs/quickstart").status_code == 200
    assert client.get("/docs/no-such-page").status_code == 404


def test_every_page_links_to_the_manual_and_the_about_page() -> None:
    text = Client().get("/login/").content.decode()
    assert 'href="/docs/"' in text and 'href="/about"' in text
