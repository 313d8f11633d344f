"""Template text left outside translation, and upper-casing of translated text, fail the suite."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = sorted((ROOT / "templates").rglob("*.html"))

# Words that are the same in every language: names, units and protocol terms.
UNTRANSLATED = {
    "llmgw",
    "API",
    "GPU",
    "GPUs",
    "CPU",
    "CPUs",
    "RAM",
    "HBM",
    "ECC",
    "XID",
    "XIDs",
    "PCIe",
    "NVLink",
    "MIG",
    "SM",
    "OpenAI",
    "Anthropic",
    "Codex",
    "Continue",
    "Cline",
    "YAML",
    "TOML",
    "JSON",
    "URL",
    "UUID",
    "OIDC",
    "SSO",
    "CSP",
    "GiB",
    "TiB",
    "MiB",
    "GB",
    "TB",
    "MB",
    "ms",
    "s",
    "W",
    "MHz",
    "°C",
    "p50",
    "p95",
    "p99",
    "vLLM",
    "SGLang",
    "llama.cpp",
    "htmx",
    "Tailwind",
    "Django",
    "Caddy",
    "nginx",
    "curl",
    "Python",
    "TypeScript",
    "AVX2",
    "CUDA",
    "OK",
    "Ctrl",
    "Enter",
    "Inter",
    "OFL",
}
TEXT_ATTRIBUTES = {"title", "placeholder", "aria-label", "alt", "value", "label"}
DJANGO = re.compile(
    r"{%\s*blocktrans(late)?\b.*?{%\s*endblocktrans(late)?\s*%}"
    r"|{%\s*comment\s*%}.*?{%\s*endcomment\s*%}|{%.*?%}|{{.*?}}|{#.*?#}",
    re.S,
)
# Examples shown as they are typed, in any language.
EXAMPLES = {"rack=r12"}
CODE = re.compile(r"<(code|pre|script|style|svg)\b.*?</\1>", re.S | re.I)
WORD = re.compile(r"[^\W\d_]{2,}")


class TextFinder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[str] = []

    def handle_data(self, data: str) -> None:
        self._check(data)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "input" and ("type", "hidden") in attrs:
            return
        for name, value in attrs:
            if name in TEXT_ATTRIBUTES and value and not (tag == "option" and name == "value"):
                if tag in {"input", "button", "option"} and name == "value":
                    continue  # form values are data the server reads, not text people read
                self._check(value)

    def _check(self, text: str) -> None:
        if text.strip() in EXAMPLES:
            return
        words = [w for w in WORD.findall(text) if w not in UNTRANSLATED]
        if words:
            self.found.append(text.strip()[:80])


def untranslated(template: Path) -> list[str]:
    source = template.read_text(encoding="utf-8")
    source = DJANGO.sub(" ", source)
    source = CODE.sub(" ", source)
    finder = TextFinder()
    finder.feed(source)
    return finder.found


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: str(p.relative_to(ROOT / "templates")))
def test_no_template_text_is_left_outside_translation(template: Path) -> None:
    assert untranslated(template) == []


def test_translated_text_is_never_upper_cased_in_code() -> None:
    # Turkish has a dotted and a dotless i: upper-casing in code gets it wrong; CSS `uppercase` with
    # lang="tr" on the page does it right.
    offenders = []
    sources = [*(ROOT / "templates").rglob("*.html"), *(ROOT / "apps").rglob("*.py"), *(ROOT / "llmgw").rglob("*.py")]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        if "|upper" in text or re.search(r"_\([^)]*\)\.upper\(\)|gettext\([^)]*\)\.upper\(\)", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_check_finds_text_and_attributes_left_in_english(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text(
        '{% load i18n %}<p>{% translate "Nodes" %}</p><p>Left behind</p>'
        '<input placeholder="Your name"><span title="{% translate \'ok\' %}">GPU</span>'
        "{% blocktranslate trimmed %}Fine {{ x }}{% endblocktranslate %}<code>llmgw ctl nodes</code>"
    )
    assert untranslated(page) == ["Left behind", "Your name"]
