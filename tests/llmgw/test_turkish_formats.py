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
