"""The small forms on a model's card: replica counts, capacity class, memory and cores per profile.

Each form only parses; the view compares with what is stored and hands the service only what
changed, and the service's own validation (Model.clean, Profile.clean) decides what is allowed.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.utils.translation import gettext_lazy as _

from apps.catalog import services
from apps.catalog.choices import CapacityClass
from apps.catalog.models import Model, Profile

__all__ = ["ClassForm", "ResourcesForm", "TargetForm", "memory_text"]

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
        return cls(data, initial={"min_replicas": model.min_replicas, "max_replicas": model.max_replicas},
                   auto_id="target-%s")


class ClassForm(forms.Form):
    capacity_class = forms.ChoiceField(label=_("Capacity class"), choices=CapacityClass.choices, required=False)

    @classmethod
    def for_model(cls, model: Model, data: Any = None) -> ClassForm:
        return cls(data, initial={"capacity_class": model.capacity_class}, auto_id="class-%s")


class ResourcesForm(forms.Form):
    profile = forms.CharField(widget=forms.HiddenInput, max_length=100)
    memory = forms.CharField(label=_("Memory"), max_length=32,
                             help_text=_("A size such as 24GiB, 512MiB, or a number of gigabytes."))
    cpu_cores = forms.FloatField(label=_("CPU cores"), min_value=0, max_value=4096)

    @classmethod
    def for_profile(cls, profile: Profile, data: Any = None) -> ResourcesForm:
        return cls(data, initial={"profile": profile.name, "memory": memory_text(profile.memory_bytes),
                                  "cpu_cores": profile.cpu_cores}, auto_id=f"resources-{profile.pk}-%s")

    def clean_memory(self) -> int:
        text = self.cleaned_data["memory"]
        try:
            return services.parse_memory(text)
        except ValueError:
            raise forms.ValidationError(
                _("Expected a size such as 24GB, 512MiB or a number of gigabytes; got “%(value)s”."),
                code="memory", params={"value": text},
            ) from None
