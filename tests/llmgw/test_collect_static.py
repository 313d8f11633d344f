"""`llmgw up` collects the static files only when they changed since the last collection into the
same folder: every start used to hash and compress all of them again (3-4 s of CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings
from django.test import override_settings

from llmgw.cli.up import COLLECTED_STAMP, collect_static


def manifest(root: Path) -> dict[str, str]:
    return json.loads((root / "staticfiles.json").read_text())["paths"]


def test_static_files_are_collected_once_until_a_source_changes(tmp_path: Path) -> None:
    sources, root = tmp_path / "sources", tmp_path / "static"
    sources.mkdir()
    root.mkdir()
    page = sources / "extra.css"
    page.write_text("body { color: black; }\n")
    served = {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"}  # as in production
    storages = {**settings.STORAGES, "staticfiles": served}
    with override_settings(STATIC_ROOT=str(root), STATICFILES_DIRS=[str(sources)], STORAGES=storages):
        assert collect_static() is True
        first = manifest(root)["extra.css"]
        assert (root / first).read_text() == "body { color: black; }\n"
        assert (root / COLLECTED_STAMP).exists()

        assert collect_static() is False  # nothing changed: nothing collected again

        page.write_text("body { color: navy; }\n")
        os.utime(page, ns=(page.stat().st_atime_ns, page.stat().st_mtime_ns + 1_000_000))
        assert collect_static() is True
        second = manifest(root)["extra.css"]
        assert second != first
        assert (root / second).read_text() == "body { color: navy; }\n"

        (root / COLLECTED_STAMP).unlink()  # a folder emptied by hand is collected again
        assert collect_static() is True
        assert manifest(root)["extra.css"] == second
