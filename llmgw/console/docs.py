"""The manual at /docs: docs/*.md (English) and docs/tr/*.md (Turkish), rendered on the server.

One list, docs/index.yaml, gives the documents in reading order with their titles and
summaries in each language; the sidebar and the index page are built from it. A page is
shown in the person's language when that document exists in it, else in English with a note.

The Markdown is ours, yet raw HTML in it is escaped rather than passed through, and a link
whose scheme is not http, https or mailto loses its target. Links between documents stay in
the portal (`clients.md#x` -> /docs/clients#x); links to other files of the repository
(`../deploy/llmgw-web.service`) go to settings.REPOSITORY_URL. Headings get anchors (toc's
permalinks), so no script is needed anywhere.

Public unless settings.DOCS_REQUIRE_SIGNIN (LLMGW_DOCS_REQUIRE_SIGNIN) sends strangers to sign in.
"""

from __future__ import annotations

import functools
import posixpath
import re
import xml.etree.ElementTree as etree
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import markdown
import yaml
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.translation import get_language
from django.utils.translation import gettext as _
from django.views.decorators.http import require_safe
from markdown.extensions import Extension
from markdown.extensions.toc import slugify_unicode
from markdown.treeprocessors import Treeprocessor

from apps.accounts.access import is_signed_in, public

__all__ = [
    "DEFAULT_LANGUAGE",
    "Document",
    "Rendered",
    "docs_dir",
    "docs_index",
    "docs_page",
    "manual",
    "manual_language",
    "render_markdown",
    "rewrite_link",
]

DEFAULT_LANGUAGE = "en"
# The languages the manual is written in besides English: each is a folder of docs/.
TRANSLATIONS = ("tr",)
SAFE_SCHEMES = {"http", "https", "mailto"}
DOCUMENT = re.compile(r"docs/(?:(?:" + "|".join(TRANSLATIONS) + r")/)?([a-z0-9][a-z0-9-]*)\.md")


@dataclass(frozen=True)
class Document:
    """One entry of docs/index.yaml: titles and summaries keyed by language code."""

    slug: str
    titles: dict[str, str]
    summaries: dict[str, str]

    def title(self, language: str) -> str:
        return self.titles.get(language) or self.titles[DEFAULT_LANGUAGE]

    def summary(self, language: str) -> str:
        return self.summaries.get(language) or self.summaries.get(DEFAULT_LANGUAGE, "")


@dataclass(frozen=True)
class Rendered:
    html: str
    toc: list[dict[str, Any]]  # toc's tokens: level, id, name, children


def docs_dir() -> Path:
    """Where the manual lives (tests point settings.DOCS_DIR elsewhere)."""
    return Path(getattr(settings, "DOCS_DIR", None) or settings.BASE_DIR / "docs")


def manual_language() -> str:
    """The language the manual is shown in: the person's, when the manual is written in it."""
    code = (get_language() or DEFAULT_LANGUAGE).split("-")[0].lower()
    return code if code in TRANSLATIONS else DEFAULT_LANGUAGE


def source_path(slug: str, language: str) -> Path:
    root = docs_dir()
    return root / f"{slug}.md" if language == DEFAULT_LANGUAGE else root / language / f"{slug}.md"


# The list ----------------------------------------------------------------------------------------


def manual() -> list[Document]:
    index = docs_dir() / "index.yaml"
    return list(_manual(str(index), index.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _manual(path: str, mtime_ns: int) -> tuple[Document, ...]:
    with open(path, encoding="utf-8") as handle:
        entries = yaml.safe_load(handle) or []
    documents = []
    for entry in entries:
        titles = {str(k): str(v) for k, v in (entry.get("title") or {}).items()}
        if not entry.get("slug") or DEFAULT_LANGUAGE not in titles:
            raise ValueError(f"{path}: every entry needs a slug and an English title: {entry!r}")
        summaries = {str(k): str(v) for k, v in (entry.get("summary") or {}).items()}
        documents.append(Document(slug=str(entry["slug"]), titles=titles, summaries=summaries))
    return tuple(documents)


# Rendering ---------------------------------------------------------------------------------------


def rewrite_link(href: str, *, folder: str, slugs: set[str] | frozenset[str], repository: str) -> str | None:
    """Where a link in the document at `folder` ("docs" or "docs/tr") should point; None drops it."""
    parts = urlsplit(href.strip())
    if parts.scheme or parts.netloc:
        return href if parts.scheme.lower() in SAFE_SCHEMES else None
    if not parts.path or parts.path.startswith("/"):
        return href  # an anchor in this page, or a page of this server (/api/v1/docs)
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    target = posixpath.normpath(posixpath.join(folder, parts.path))
    if target == ".." or target.startswith("../"):
        return None  # outside the repository
    match = DOCUMENT.fullmatch(target)
    if match and match.group(1) in slugs:
        return reverse("docs-page", args=[match.group(1)]) + fragment
    suffix = "/" if parts.path.endswith("/") else ""
    return f"{repository}/{target}{suffix}{fragment}"


class _NoRawHtml(Extension):
    """Raw HTML in the source is shown as text: no block or inline HTML is passed through."""

    def extendMarkdown(self, md: markdown.Markdown) -> None:  # noqa: N802 - Markdown's API
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")


class _Links(Treeprocessor):
    def __init__(self, md: markdown.Markdown, folder: str, slugs: frozenset[str], repository: str) -> None:
        super().__init__(md)
        self.folder, self.slugs, self.repository = folder, slugs, repository

    def run(self, root: etree.Element) -> None:
        for element in root.iter():
            for attribute in ("href", "src"):
                value = element.get(attribute)
                if value is None or (element.tag == "a" and "headerlink" in (element.get("class") or "")):
                    continue
                target = rewrite_link(value, folder=self.folder, slugs=self.slugs, repository=self.repository)
                if target is None:
                    del element.attrib[attribute]
                else:
                    element.set(attribute, target)


class _LinkExtension(Extension):
    def __init__(self, folder: str, slugs: frozenset[str], repository: str) -> None:
        super().__init__()
        self.folder, self.slugs, self.repository = folder, slugs, repository

    def extendMarkdown(self, md: markdown.Markdown) -> None:  # noqa: N802 - Markdown's API
        # After the inline patterns made the links (20), before toc (5) adds its own.
        md.treeprocessors.register(_Links(md, self.folder, self.slugs, self.repository), "llmgw_links", 15)


def render_markdown(
    text: str, *, folder: str, slugs: frozenset[str], repository: str, permalink_title: str = "Permanent link"
) -> Rendered:
    md = markdown.Markdown(
        extensions=[
            _NoRawHtml(),
            "tables",
            "fenced_code",
            "toc",
            _LinkExtension(folder, slugs, repository),
        ],
        extension_configs={
            "toc": {
                "permalink": True,
                "permalink_class": "headerlink",
                "permalink_title": permalink_title,
                "slugify": slugify_unicode,
                "toc_depth": "2-3",
            }
        },
        output_format="html",
    )
    html = md.convert(text)
    return Rendered(html=html, toc=list(getattr(md, "toc_tokens", [])))


@functools.lru_cache(maxsize=64)
def _render_file(
    path: str, mtime_ns: int, folder: str, slugs: frozenset[str], repository: str, permalink_title: str
) -> Rendered:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    return render_markdown(text, folder=folder, slugs=slugs, repository=repository, permalink_title=permalink_title)


def render_document(slug: str, language: str, slugs: frozenset[str]) -> Rendered:
    path = source_path(slug, language)
    folder = "docs" if language == DEFAULT_LANGUAGE else f"docs/{language}"
    return _render_file(str(path), path.stat().st_mtime_ns, folder, slugs, settings.REPOSITORY_URL, _("Permanent link"))


# Views -------------------------------------------------------------------------------------------


def _signin_first(request: HttpRequest) -> HttpResponse | None:
    if getattr(settings, "DOCS_REQUIRE_SIGNIN", False) and not is_signed_in(request.user):
        return redirect_to_login(request.get_full_path())
    return None


def _sidebar(documents: list[Document], language: str, current: str | None) -> list[dict[str, Any]]:
    return [
        {
            "slug": d.slug,
            "title": d.title(language),
            "summary": d.summary(language),
            "url": reverse("docs-page", args=[d.slug]),
            "current": d.slug == current,
        }
        for d in documents
    ]


@public
@require_safe
def docs_index(request: HttpRequest) -> HttpResponse:
    """The manual's contents, in reading order."""
    refused = _signin_first(request)
    if refused is not None:
        return refused
    language = manual_language()
    return render(
        request,
        "console/docs_index.html",
        {
            "manual": _sidebar(manual(), language, None),
        },
    )


@public
@require_safe
def docs_page(request: HttpRequest, slug: str) -> HttpResponse:
    """One document, in the person's language where it is written in it."""
    refused = _signin_first(request)
    if refused is not None:
        return refused
    if slug.endswith(".md"):  # a link copied from the repository
        return HttpResponseRedirect(reverse("docs-page", args=[slug[:-3]]))
    language = manual_language()
    documents = manual()
    sidebar = _sidebar(documents, language, slug)
    document = next((d for d in documents if d.slug == slug), None)
    if document is None or not source_path(slug, DEFAULT_LANGUAGE).is_file():
        return render(request, "console/docs_missing.html", {"manual": sidebar, "slug": slug}, status=404)
    shown = language if source_path(slug, language).is_file() else DEFAULT_LANGUAGE
    page = render_document(slug, shown, frozenset(d.slug for d in documents))
    return render(
        request,
        "console/docs_page.html",
        {
            "manual": sidebar,
            "document": document,
            "title": document.title(shown),
            "article": page.html,
            "toc": page.toc,  # the page's second-level headings, for the sidebar
            "article_language": shown,
            "untranslated": shown != language,
        },
    )
