"""The rows written back after a flush (tests/after_flush.py) are the ones Django's own post_migrate
receivers make, with the same ids each time, and rows made afterwards get ids of their own."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command

from tests import after_flush

pytestmark = pytest.mark.django_db(transaction=True)


def flush(*, reset_sequences: bool = False) -> None:
    """As a transactional test's teardown flushes (with reset_sequences=False), or as the command
    does by default (True)."""
    call_command("flush", interactive=False, verbosity=0, reset_sequences=reset_sequences)


def natural_rows() -> tuple[set[tuple[str, str]], set[tuple[str, str, str, str]]]:
    types = set(ContentType.objects.values_list("app_label", "model"))
    permissions = set(
        Permission.objects.values_list("codename", "name", "content_type__app_label", "content_type__model")
    )
    return types, permissions


def test_a_flush_writes_back_what_djangos_receivers_make() -> None:
    flush()
    flush()  # the second at the latest writes the kept rows back
    written_back = natural_rows()
    assert written_back[0] and written_back[1]

    Permission.objects.all().delete()
    ContentType.objects.all().delete()
    ContentType.objects.clear_cache()
    after_flush._emit(0, False, "default")
    assert natural_rows() == written_back


def test_the_rows_keep_their_ids_from_one_flush_to_the_next() -> None:
    flush()
    flush()
    before = sorted(ContentType.objects.values_list("pk", "app_label", "model"))
    flush()  # Django's own receivers would make new ids
    assert sorted(ContentType.objects.values_list("pk", "app_label", "model")) == before


@pytest.mark.parametrize("reset_sequences", [False, True])
def test_rows_made_after_a_flush_get_new_ids(reset_sequences: bool) -> None:
    flush(reset_sequences=reset_sequences)
    flush(reset_sequences=reset_sequences)
    most = max(ContentType.objects.values_list("pk", flat=True))
    made = ContentType.objects.create(app_label="tests", model="made_after_flush")
    assert made.pk > most
    permission = Permission.objects.create(codename="made_after_flush", name="made", content_type=made)
    assert permission.pk
    assert ContentType.objects.get_for_model(Permission).model == "permission"
