"""What the catalogue tells the accounts app (registered in CatalogConfig.ready(), through
apps.accounts.extensions): the models an organisation, team or project owns, which stop its
removal, and the live models people may choose for a key or an editor."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from django.utils.translation import ngettext

from apps.accounts.models import Organization, Project, Team
from apps.catalog.models import Model

__all__ = ["count_models", "live_models", "models_phrase"]


def count_models(branch: Organization | Team | Project) -> int:
    """The models the branch or any branch below it owns."""
    if isinstance(branch, Organization):
        owned = Q(organization=branch) | Q(team__organization=branch) | Q(project__team__organization=branch)
    elif isinstance(branch, Team):
        owned = Q(team=branch) | Q(project__team=branch)
    else:
        owned = Q(project=branch)
    return Model.objects.filter(owned).count()


def models_phrase(count: int) -> str:
    return ngettext("%(count)d model", "%(count)d models", count)


def live_models() -> QuerySet[Model]:
    return Model.objects.live().order_by("name")
