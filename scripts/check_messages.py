"""Check the Turkish catalogue: every string of the code is in it, translated, with the
same placeholders as the English, not fuzzy, and the compiled .mo matches the .po.

Run from the repository root with the project's virtualenv (scripts/test does).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCALES = ["tr"]
PLACEHOLDER = re.compile(r"%\([a-zA-Z_]+\)[sdif]|%[sdif]|\{[a-zA-Z_0-9]*\}")
IGNORES = [".venv", "var", "node_modules", "tests", "bench", "build", "docs"]


def parse_po(text: str) -> list[dict[str, object]]:
    """A small PO reader: enough for msgid/msgid_plural/msgstr[n], contexts and flags."""
    entries: list[dict[str, object]] = []
    current: dict[str, object] = {}
    key = ""

    def flush() -> None:
        nonlocal current
        if "msgid" in current:
            entries.append(current)
        current = {}

    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            flush()
            continue
        if line.startswith("#,"):
            current.setdefault("flags", set()).update(f.strip() for f in line[2:].split(","))  # type: ignore[union-attr]
            continue
        if line.startswith("#"):
            continue
        match = re.match(r'^(msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)\s+"(.*)"$', line)
        if match:
            if match.group(1) in {"msgctxt", "msgid"} and "msgstr" in " ".join(current):
                flush()
            key = match.group(1)
            current[key] = _unescape(match.group(2))
            continue
        if line.startswith('"') and key:
            current[key] = str(current[key]) + _unescape(line[1:-1])
    flush()
    return entries


def _unescape(text: str) -> str:
    escapes = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
    return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(1)), text)


def placeholders(text: str) -> list[str]:
    return sorted(PLACEHOLDER.findall(text))


def check_catalogue(po: Path) -> list[str]:
    problems = []
    for entry in parse_po(po.read_text(encoding="utf-8")):
        msgid = str(entry["msgid"])
        if not msgid:
            continue
        if "fuzzy" in entry.get("flags", set()):  # type: ignore[operator]
            problems.append(f"{po}: fuzzy translation for {msgid!r}")
        translations = [str(v) for k, v in entry.items() if k.startswith("msgstr")]
        if not translations or any(not t for t in translations):
            problems.append(f"{po}: no translation for {msgid!r}")
            continue
        english = placeholders(msgid)
        plural = entry.get("msgid_plural")
        for text in translations:
            got = placeholders(text)
            # a plural form may use the plural's placeholders, or leave out the count
            plural_ok = bool(plural) and set(got) <= set(english) | set(placeholders(str(plural)))
            if got != english and not plural_ok:
                problems.append(f"{po}: placeholders differ for {msgid!r}: {english} vs {got}")
    return problems


def msgids(po: Path) -> set[str]:
    return {str(e["msgid"]) for e in parse_po(po.read_text(encoding="utf-8")) if e["msgid"]}


def check_extracted(locale: str, po: Path) -> list[str]:
    """Run makemessages on a copy and report strings of the code that the catalogue lacks."""
    with tempfile.TemporaryDirectory() as tmp:
        backup = Path(tmp) / "django.po"
        shutil.copy2(po, backup)
        env = dict(os.environ, LLMGW_DATA_DIR=tmp)
        try:
            subprocess.run(
                [
                    sys.executable,
                    "manage.py",
                    "makemessages",
                    "-l",
                    locale,
                    "--no-location",
                    "--no-obsolete",
                    *[arg for name in IGNORES for arg in ("--ignore", f"{name}/*")],
                ],
                cwd=ROOT,
                env=env,
                check=True,
                capture_output=True,
            )
            fresh = msgids(po)
        finally:
            shutil.copy2(backup, po)
    missing = sorted(fresh - msgids(po))
    return (
        [f"{po}: {len(missing)} string(s) of the code are not in the catalogue, e.g. {missing[:5]!r}"]
        if missing
        else []
    )


def check_compiled(po: Path) -> list[str]:
    mo = po.with_suffix(".mo")
    if not mo.exists():
        return [f"{mo} is missing: run `make messages`"]
    if shutil.which("msgfmt") is None:
        return []
    compiled = subprocess.run(["msgfmt", "-o", "-", str(po)], check=True, capture_output=True).stdout
    if compiled != mo.read_bytes():
        return [f"{mo} is older than {po.name}: run `make messages`"]
    return []


def main() -> int:
    problems: list[str] = []
    for locale in LOCALES:
        po = ROOT / "locale" / locale / "LC_MESSAGES" / "django.po"
        if not po.exists():
            problems.append(f"{po} is missing")
            continue
        problems += check_extracted(locale, po)
        problems += check_catalogue(po)
        problems += check_compiled(po)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
