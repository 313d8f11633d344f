"""The Django admin in Turkish: every app's heading on its index is in Turkish, as the rest of the
console is (ACCOUNTS, CATALOG, CLUSTER, GATEWAY and QUOTAS stayed English: their apps named none)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.apps import apps
from django.utils.functional import Promise

pytestmark = pytest.mark.django_db


def _headings(client: Any, language: str) -> dict[str, str]:
    page = client.get("/django-admin/", headers={"accept-language": language}).content.decode()
    found = re.findall(r'<caption>\s*<a href="/django-admin/(\w+)/"[^>]*>(.*?)</a>', page, re.S)
    return {label: text.strip() for label, text in found}


def test_every_app_of_llmgw_names_itself_for_translation() -> None:
    ours = [config for config in apps.get_app_configs() if config.name.startswith(("apps.", "llmgw."))]
    unnamed = [config.name for config in ours if config.models_module and not isinstance(config.verbose_name, Promise)]
    assert unnamed == []


def test_the_admins_app_headings_are_in_turkish(client: Any, alice: Any) -> None:
    client.force_login(alice)
    english, turkish = _headings(client, "en"), _headings(client, "tr")
    assert set(english) == set(turkish) and {"accounts", "catalog", "cluster", "gateway", "quotas"} <= set(english)
    untranslated = sorted(f"{label}: {english[label]}" for label in english if turkish[label] == english[label])
    assert untranslated == []
