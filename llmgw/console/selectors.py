"""Read-side queries for the console's shell."""

from __future__ import annotations

from django.apps import apps

__all__ = ["landing_counts"]

# (label, app_label.Model) pairs counted on the landing page; a model that an app has not
# defined yet counts as 0, which is exactly how many of it exist.
COUNTED = (("nodes", "cluster.Node"), ("models", "catalog.Model"), ("replicas", "cluster.Replica"))


def landing_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for label, dotted in COUNTED:
        app_label, model_name = dotted.split(".")
        try:
            model = apps.get_model(app_label, model_name)
        except LookupError:
            counts[label] = 0
            continue
        counts[label] = model._default_manager.count()
    return counts
