from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_messages", ROOT / "scripts" / "check_messages.py")
assert spec and spec.loader
check_messages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_messages)


def write_po(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "django.po"
    path.write_text('msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\n' + body, encoding="utf-8")
    return path


def test_a_message_turkish_lacks_is_refused(tmp_path: Path) -> None:
    po = write_po(tmp_path, 'msgid "Nodes"\nmsgstr ""\n')
    assert check_messages.check_catalogue(po) == [f"{po}: no translation for 'Nodes'"]


def test_a_translation_with_other_placeholders_is_refused(tmp_path: Path) -> None:
    po = write_po(tmp_path, 'msgid "has %(have)s GB, needs %(need)s"\nmsgstr "%(have)s GB var"\n')
    problems = check_messages.check_catalogue(po)
    assert len(problems) == 1 and "placeholders differ" in problems[0]


def test_a_fuzzy_translation_is_refused(tmp_path: Path) -> None:
    po = write_po(tmp_path, '#, fuzzy\nmsgid "Nodes"\nmsgstr "Düğümler"\n')
    assert "fuzzy" in check_messages.check_catalogue(po)[0]


def test_the_turkish_catalogue_is_complete() -> None:
    po = ROOT / "locale" / "tr" / "LC_MESSAGES" / "django.po"
    assert check_messages.check_catalogue(po) == []
    assert check_messages.check_compiled(po) == []
