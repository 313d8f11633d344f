"""What the test database holds again after a transactional test empties it, quickly.

After a test that commits (pytest-django's `transactional_db`, a live server), Django empties every
table and then sends post_migrate, whose receivers (contenttypes' and auth's) build the content
types and permissions again: a query per app and per model, 0.1-0.3 s each time, paid by every such
test on both databases. Those rows are the same each time, so the first flush of a test process
sends the signal as Django does and keeps what it made; later flushes write the same rows back
(same ids, two inserts) and move the tables' id sequences past them.

If a receiver other than those (RECEIVERS) listens to post_migrate, the signal is sent as Django
does every time.
"""

from __future__ import annotations

from typing import Any

from django.core.management.commands import flush
from django.db.models.signals import post_migrate

_emit = flush.emit_post_migrate_signal

#: The post_migrate receivers here, by name: the two whose rows are kept, and auth's renaming of
#: permissions, which acts on a migration plan's RenameModel operations (a flush has no plan).
RECEIVERS = {"create_contenttypes", "create_permissions", "rename_permissions_after_model_rename"}

_ROWS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}


def _only_known_receivers() -> bool:
    names = set()
    for _key, receiver, *_rest in post_migrate.receivers:
        function = receiver() if callable(receiver) and not hasattr(receiver, "__name__") else receiver
        names.add(getattr(function, "__name__", repr(function)))
    return names <= RECEIVERS


def emit_after_flush(verbosity: int, interactive: bool, db: str, **kwargs: Any) -> None:
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.color import no_style
    from django.db import connections

    rows = _ROWS.get(db)
    if rows is None or not _only_known_receivers():
        _emit(verbosity, interactive, db, **kwargs)
        _ROWS[db] = (list(ContentType.objects.using(db).values()), list(Permission.objects.using(db).values()))
        return
    types, permissions = rows
    ContentType.objects.using(db).bulk_create([ContentType(**row) for row in types])
    Permission.objects.using(db).bulk_create([Permission(**row) for row in permissions])
    connection = connections[db]
    with connection.cursor() as cursor:
        for statement in connection.ops.sequence_reset_sql(no_style(), [ContentType, Permission]):
            cursor.execute(statement)
    ContentType.objects.clear_cache()


def install() -> None:
    flush.emit_post_migrate_signal = emit_after_flush  # type: ignore[attr-defined]
