"""The about page: public, the reverse-proxy examples of deploy/proxy shown exactly as the files
are, and fonts served by this installation (with the Latin Extended letters Turkish needs)."""

from __future__ import annotations

import re
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.contrib.staticfiles import finders
from django.test import Client

from llmgw.console.about import PROXY_EXAMPLES
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
STYLESHEET = "css/dist/styles.css"
FONTS = ROOT / "llmgw" / "console" / "static" / "console" / "fonts"
TURKISH = "çğıöşüÇĞİÖŞÜ"
WEIGHTS = (400, 600, 700)  # font-normal, font-semibold and font-bold on the page


class Resources(HTMLParser):
    """Every URL the page makes a browser fetch by itself (not the links a person may follow)."""

    FETCHED = {
        ("link", "href"),
        ("script", "src"),
        ("img", "src"),
        ("img", "srcset"),
        ("source", "src"),
        ("source", "srcset"),
        ("iframe", "src"),
        ("video", "src"),
        ("audio", "src"),
        ("object", "data"),
        ("embed", "src"),
        ("image", "href"),
        ("use", "href"),
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.urls: list[str] = []
        self.stylesheets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if (tag, name) in self.FETCHED and value:
                self.urls.append(value)
                if tag == "link" and "stylesheet" in (dict(attrs).get("rel") or ""):
                    self.stylesheets.append(value)
            if name == "style" and value:
                self.urls += re.findall(r"url\(([^)]*)\)", value)


def is_local(url: str) -> bool:
    parts = urlsplit(url.strip().strip("'\""))
    return not parts.scheme and not parts.netloc and not url.strip().startswith("//")


def stylesheet_text() -> str:
    path = finders.find(STYLESHEET)
    assert path, f"{STYLESHEET} is not among the static files"
    return Path(path).read_text(encoding="utf-8")


def font_faces(css: str) -> list[dict[str, str]]:
    faces = []
    for body in re.findall(r"@font-face\s*\{([^}]*)\}", css):
        declarations = {}
        for declaration in body.split(";"):
            name, _, value = declaration.partition(":")
            if value:
                declarations[name.strip()] = value.strip()
        faces.append(declarations)
    return faces


def code_points(unicode_range: str) -> set[int]:
    points: set[int] = set()
    for part in unicode_range.split(","):
        part = part.strip().upper().removeprefix("U+")
        if "-" in part:
            low, high = part.split("-")
        elif "?" in part:
            low, high = part.replace("?", "0"), part.replace("?", "F")
        else:
            low = high = part
        points.update(range(int(low, 16), int(high, 16) + 1))
    return points


# The page ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("language", ["en", "tr"])
def test_the_about_page_is_public_and_strict(language: str) -> None:
    client = Client()
    client.get(f"/_lang/{language}")
    response = client.get("/about")
    assert response.status_code == 200
    check_body(response, check_strict(response, "/about"), "/about")
    text = response.content.decode()
    assert f'<html lang="{language}">' in text
    assert 'class="about-page' in text
    assert 'href="/docs/quickstart"' in text and 'href="/docs/install"' in text


def test_the_proxy_examples_are_shown_exactly_as_the_files_are() -> None:
    text = Client().get("/about").content.decode()
    assert len(PROXY_EXAMPLES) == 2
    for _label, path in PROXY_EXAMPLES:
        match = re.search(rf'<pre[^>]*data-file="{re.escape(path)}"[^>]*><code>(.*?)</code></pre>', text, re.S)
        assert match, f"{path} is not on the page"
        assert unescape(match.group(1)) == (ROOT / path).read_text(encoding="utf-8"), path
        assert f"https://github.com/llmgw/llmgw/blob/main/{path}" in text


def test_the_proxy_examples_do_what_the_manual_says() -> None:
    caddy = (ROOT / "deploy/proxy/caddy/Caddyfile").read_text()
    assert "reverse_proxy 127.0.0.1:8000" in caddy and "flush_interval -1" in caddy
    nginx = (ROOT / "deploy/proxy/nginx/llmgw.conf").read_text()
    websocket = nginx.split("location /ws/agent/", 1)[1].split("}", 1)[0]
    assert "proxy_set_header Upgrade $http_upgrade;" in websocket
    assert "proxy_set_header Connection $connection_upgrade;" in websocket
    gateway = nginx.split("location /v1/", 1)[1].split("}", 1)[0]
    assert "proxy_buffering off;" in gateway
    # nginx inherits no proxy_set_header into a location that sets its own: each one sets all.
    for location in re.findall(r"location [^{]+\{([^}]*)\}", nginx):
        if "proxy_pass" in location:
            assert "X-Forwarded-Proto $scheme" in location and "X-Forwarded-For $remote_addr" in location


# Fonts -------------------------------------------------------------------------------------------


def test_the_page_and_its_stylesheet_reference_no_other_host() -> None:
    page = Resources()
    page.feed(Client().get("/about").content.decode())
    assert page.stylesheets, "the page has no stylesheet"
    assert [url for url in page.urls if not is_local(url)] == []
    css = stylesheet_text()
    urls = re.findall(r"url\(([^)]*)\)", css)
    assert urls, "the stylesheet loads no fonts"
    assert [url for url in urls if not is_local(url)] == []
    assert not re.search(r"@import\s+(url\()?['\"]?(https?:)?//", css)
    assert "fonts.googleapis" not in css and "fonts.gstatic" not in css
    # Every file the stylesheet names is a static file of this installation.
    for url in urls:
        relative = url.strip().strip("'\"")
        resolved = Path("css/dist", relative).as_posix()
        while "/../" in resolved or resolved.startswith("../"):
            resolved = re.sub(r"[^/]+/\.\./", "", resolved, count=1)
        assert finders.find(resolved), f"{url} -> {resolved} is not a static file"


def test_the_fonts_carry_turkish_letters() -> None:
    faces = [face for face in font_faces(stylesheet_text()) if face.get("font-family", "").strip("'\"") == "Inter"]
    assert faces, "no @font-face for Inter"
    for weight in WEIGHTS:
        of_weight = [face for face in faces if face.get("font-weight") == str(weight)]
        sources = " ".join(face["src"] for face in of_weight)
        assert f"inter-latin-{weight}-normal.woff2" in sources and f"inter-latin-ext-{weight}-normal.woff2" in sources
        covered: set[int] = set()
        for face in of_weight:
            covered |= code_points(face["unicode-range"])
        missing = [char for char in TURKISH + "AZaz09" if ord(char) not in covered]
        assert missing == [], f"weight {weight} lacks {missing}"
    for weight in WEIGHTS:
        for subset in ("latin", "latin-ext"):
            font = FONTS / f"inter-{subset}-{weight}-normal.woff2"
            assert font.read_bytes()[:4] == b"wOF2", font
    assert "SIL Open Font License" in (FONTS / "OFL.txt").read_text()


def test_the_unicode_range_reader(tmp_path: Any) -> None:
    assert code_points("U+??") == set(range(0x100))
    assert code_points("U+131, U+100-102") == {0x131, 0x100, 0x101, 0x102}
    assert is_local("../../console/fonts/a.woff2") and is_local("/static/x.css")
    assert not is_local("https://fonts.gstatic.com/a.woff2") and not is_local("//cdn.example/a.css")
