from __future__ import annotations

from datetime import UTC, datetime

from django.template import Context, Template
from django.utils import translation

from apps.cluster.templatetags.cluster_tags import gib


def test_numbers_use_the_turkish_decimal_comma() -> None:
    with translation.override("tr"):
        assert gib(int(7.5 * 1024**3)) == "7,5 GiB"
    with translation.override("en"):
        assert gib(int(7.5 * 1024**3)) == "7.5 GiB"


def test_dates_use_turkish_month_names() -> None:
    moment = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    with translation.override("tr"):
        assert "Kasım" in Template('{{ when|date:"j F Y" }}').render(Context({"when": moment}))


def test_memory_under_a_gib_reads_in_mib_and_unknown_reads_as_a_dash() -> None:
    with translation.override("en"):
        assert gib(19 * 1024**2) == "19 MiB"  # an engine's measured memory, not "0.0 GiB"
        assert gib(int(2.5 * 1024**2)) == "2.5 MiB"
        assert gib(0) == "0.0 GiB"
        assert gib(3 * 1024**4) == "3.0 TiB"
        assert gib(None) == "-"
    with translation.override("tr"):
        assert gib(int(2.5 * 1024**2)) == "2,5 MiB"
