"""The chat page's replies as HTML, made on the server: Markdown, with nothing raw let through.

A model's answer is untrusted text. It is rendered with Python-Markdown when that is installed,
with its raw-HTML handling switched off, so `<script>` in an answer is shown as text; links keep
only http, https and mailto targets (and relative ones), and images become their alt text, so
an answer cannot make the page fetch anything. Code blocks stay code blocks. Math (`$…$`,
`$$…$$`, `\\(…\\)`, `\\[…\\]`) is kept as it was written, in `<span class="math">`, out of
Markdown's reach so that its underscores and stars are not read as emphasis. A single `$` opens
math only before a non-space and closes it only after one, not before a digit, and never spans
a backtick or a line, so "$5 and $10" stays prices (Pandoc's rule, narrowed).

Without Python-Markdown the text is escaped and only fenced code blocks and paragraphs are kept.
"""

from __future__ import annotations

import html
import re
from typing import Any
from xml.etree import ElementTree

__all__ = ["MAX_TEXT_CHARS", "render_markdown"]

MAX_TEXT_CHARS = 200_000
SAFE_SCHEMES = ("http:", "https:", "mailto:")
AMP_SUBSTITUTE = "\x02amp\x03"  # markdown.util.AMP_SUBSTITUTE, without importing Markdown here

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})[^\n]*\n.*?(?:^\1?\2[`~]*[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)
# Inline code first (so math inside it stays code), then the math forms, longest delimiters first.
_INLINE = re.compile(
    r"(?P<code>(?P<ticks>`+).+?(?P=ticks))"
    r"|\$\$(?P<display>.+?)\$\$"
    r"|\\\[(?P<bracket>.+?)\\\]"
    r"|\\\((?P<paren>.+?)\\\)"
    r"|(?<![\\$\w])\$(?P<dollar>[^\s$`](?:[^$`\n]*?[^\s$`\\])?)\$(?![\d$])",
    re.DOTALL,
)
_TOKEN = "LLMGWMATH{}X"
_TOKEN_RE = re.compile(r"LLMGWMATH(\d+)X")


def _protect_math(text: str) -> tuple[str, list[tuple[str, bool]]]:
    """Replace math outside code with tokens Markdown leaves alone; return the text and the math."""
    found: list[tuple[str, bool]] = []

    def inline(match: re.Match[str]) -> str:
        if match.group("code"):
            return match.group(0)
        if match.group("display") is not None or match.group("bracket") is not None:
            display = True
        else:
            display = False
        found.append((match.group(0), display))
        return _TOKEN.format(len(found) - 1)

    parts: list[str] = []
    position = 0
    for fence in _FENCE.finditer(text):
        parts.append(_INLINE.sub(inline, text[position : fence.start()]))
        parts.append(fence.group(0))
        position = fence.end()
    parts.append(_INLINE.sub(inline, text[position:]))
    return "".join(parts), found


def _restore_math(rendered: str, found: list[tuple[str, bool]]) -> str:
    def span(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if index >= len(found):
            return match.group(0)
        source, display = found[index]
        kind = "math math-display" if display else "math"
        return f'<span class="{kind}">{html.escape(source, quote=False)}</span>'

    return _TOKEN_RE.sub(span, rendered)


def _safe_url(url: str) -> bool:
    """Relative targets, http, https and mailto; nothing else (javascript:, data:, vbscript: …).

    The URL is read as the browser will: character references decoded (Markdown keeps `&` as
    its own placeholder, put back first), then tabs, newlines and controls dropped.
    """
    cleaned = re.sub(r"[\x00-\x20]", "", html.unescape(url.replace(AMP_SUBSTITUTE, "&"))).lower()
    if not cleaned:
        return False
    scheme = re.match(r"^([a-z][a-z0-9+.-]*):", cleaned)
    return scheme is None or f"{scheme.group(1)}:" in SAFE_SCHEMES


def _markdown() -> Any:
    try:
        import markdown
        from markdown.treeprocessors import Treeprocessor
    except ImportError:
        return None

    class Harden(Treeprocessor):  # type: ignore[misc]  # markdown ships no types
        """Links keep safe targets only and open nothing new; images become their alt text."""

        def run(self, root: ElementTree.Element) -> None:
            for parent in root.iter():
                for index, child in enumerate(list(parent)):
                    if child.tag == "img":
                        replacement = ElementTree.Element("span")
                        replacement.text = child.get("alt") or ""
                        replacement.tail = child.tail
                        parent.remove(child)
                        parent.insert(index, replacement)
                    elif child.tag == "a":
                        href = child.get("href", "")
                        if not _safe_url(href):
                            child.attrib.pop("href", None)
                        child.set("rel", "noopener noreferrer nofollow")

    md = markdown.Markdown(extensions=["fenced_code", "tables", "sane_lists"], output_format="html")
    # No raw HTML: block-level and inline tags are shown as the text they are.
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    md.treeprocessors.register(Harden(md), "llmgw_harden", 0)
    return md


def _fallback(text: str) -> str:
    """Escaped paragraphs and fenced code blocks, for an installation without Python-Markdown."""
    out: list[str] = []
    position = 0

    def paragraphs(chunk: str) -> None:
        for block in re.split(r"\n\s*\n", chunk):
            if block.strip():
                out.append("<p>" + html.escape(block.strip(), quote=False).replace("\n", "<br>\n") + "</p>")

    for fence in _FENCE.finditer(text):
        paragraphs(text[position : fence.start()])
        lines = fence.group(0).split("\n")
        info = lines[0].strip().lstrip("`~").strip().split(" ")[0]
        body = "\n".join(lines[1:])
        body = re.sub(r"\n?[ ]{0,3}(`{3,}|~{3,})[ \t]*$", "", body)
        language = f' class="language-{html.escape(info)}"' if re.fullmatch(r"[\w.+-]+", info or "") else ""
        out.append(f"<pre><code{language}>{html.escape(body, quote=False)}\n</code></pre>")
        position = fence.end()
    paragraphs(text[position:])
    return "\n".join(out)


def render_markdown(text: str) -> str:
    """One reply as safe HTML. Texts longer than MAX_TEXT_CHARS are cut there."""
    text = str(text)[:MAX_TEXT_CHARS].replace("\r\n", "\n")
    protected, found = _protect_math(text)
    md = _markdown()
    rendered = md.convert(protected) if md is not None else _fallback(protected)
    return _restore_math(rendered, found)
