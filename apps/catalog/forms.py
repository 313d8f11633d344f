"""The small forms on a model's card: replica counts, capacity class, memory and cores per profile.

Each form only parses; the view compares with what is stored and hands the service only what
changed, and the service's own validation (Model.clean, Profile.clean) decides what is allowed.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import Organization, Project, Team
from apps.catalog import services
from apps.catalog.choices import CapacityClass
from apps.catalog.models import Model, Profile

__all__ = ["ClassForm", "OwnerForm", "ResourcesForm", "TargetForm", "memory_text"]

GIB = 1024**3
GB = 1000**3
MIB = 1024**2
MB = 1000**2


def memory_text(value: int) -> str:
    """Bytes written so that parse_memory() reads back exactly the same number (24GiB, 20GB, 512MiB)."""
    for unit, name in ((GIB, "GiB"), (GB, "GB"), (MIB, "MiB"), (MB, "MB")):
        if value and value % unit == 0:
            return f"{value // unit}{name}"
    return f"{value}B"


class TargetForm(forms.Form):
    min_replicas = forms.IntegerField(label=_("Always running"), min_value=0, max_value=1000)
    max_replicas = forms.IntegerField(label=_("Under load, up to"), min_value=0, max_value=1000)

    @classmethod
    def for_model(cls, model: Model, data: Any = None) -> TargetForm:
        return cls(
            data, initial={"min_replicas": model.min_replicas, "max_replicas": model.max_replicas}, auto_id="target-%s"
        )


class ClassForm(forms.Form):
    capacity_class = forms.ChoiceField(label=_("Capacity class"), choices=CapacityClass.choices, required=False)

    @classmethod
    def for_model(cls, model: Model, data: Any = None) -> ClassForm:
        return cls(data, initial={"capacity_class": model.capacity_class}, auto_id="class-%s")


class ResourcesForm(forms.Form):
    profile = forms.CharField(widget=forms.HiddenInput, max_length=100)
    memory = forms.CharField(
        label=_("Memory"), max_length=32, help_text=_("A size such as 24GiB, 512MiB, or a number of gigabytes.")
    )
    cpu_cores = forms.FloatField(label=_("CPU cores"), min_value=0, max_value=4096)

    @classmethod
    def for_profile(cls, profile: Profile, data: Any = None) -> ResourcesForm:
        return cls(
            data,
            initial={
                "profile": profile.name,
                "memory": memory_text(profile.memory_bytes),
                "cpu_cores": profile.cpu_cores,
            },
            auto_id=f"resources-{profile.pk}-%s",
        )

    def clean_memory(self) -> int:
        text = self.cleaned_data["memory"]
        try:
            return services.parse_memory(text)
        except ValueError:
            raise forms.ValidationError(
                _("Expected a size such as 24GB, 512MiB or a number of gigabytes; got “%(value)s”."),
                code="memory",
                params={"value": text},
            ) from None


class OwnerForm(forms.Form):
    """Whose capacity quotas the model counts against: an organisation, a team, a project, or nobody."""

    owner = forms.ChoiceField(
        label=_("Owner"), required=False, widget=forms.Select(attrs={"class": "field max-w-full"})
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choices: list[tuple[Any, Any]] = [("", "-")]
        organizations = list(Organization.objects.order_by("name"))
        teams = list(Team.objects.select_related("organization").order_by("organization__name", "name"))
        projects = list(
            Project.objects.select_related("team__organization").order_by(
                "team__organization__name", "team__name", "name"
            )
        )
        if organizations:
            choices.append((_("Organisations"), [(f"org:{o.pk}", o.name) for o in organizations]))
        if teams:
            choices.append((_("Teams"), [(f"team:{t.pk}", f"{t.organization.name} / {t.name}") for t in teams]))
        if projects:
            choices.append(
                (
                    _("Projects"),
                    [(f"project:{p.pk}", f"{p.team.organization.name} / {p.team.name} / {p.name}") for p in projects],
                )
            )
        self.fields["owner"].choices = choices  # type: ignore[attr-defined]  # a ChoiceField

    @classmethod
    def for_model(cls, model: Model, data: Any = None) -> OwnerForm:
        if model.project_id:
            current = f"project:{model.project_id}"
        elif model.team_id:
            current = f"team:{model.team_id}"
        elif model.organization_id:
            current = f"org:{model.organization_id}"
        else:
            current = ""
        return cls(data, initial={"owner": current}, auto_id="owner-%s")

    def chosen(self) -> dict[str, Any]:
        """The service's keywords for the chosen owner (all None for nobody)."""
        kind, _sep, pk = (self.cleaned_data.get("owner") or "").partition(":")
        found: dict[str, Any] = {"organization": None, "team": None, "project": None}
        if kind == "org":
            found["organization"] = Organization.objects.get(pk=pk)
        elif kind == "team":
            found["team"] = Team.objects.get(pk=pk)
        elif kind == "project":
            found["project"] = Project.objects.get(pk=pk)
        return found
