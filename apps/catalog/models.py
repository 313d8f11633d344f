"""The models operators declare, and the ways each can run (profiles)."""

from __future__ import annotations

import re
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import Organization, Project, Team
from apps.catalog.choices import CapacityClass, Engine
from apps.catalog.profile_fields import GPU_MEMORY_UTILISATION, Declared, engine_problems
from apps.catalog.scaling import Scaling

__all__ = ["Model", "Profile"]

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
GIB = 1024**3


class ModelQuerySet(models.QuerySet["Model"]):
    def live(self) -> ModelQuerySet:
        """Models not being deleted (a deleted model's row stays until its replicas stopped)."""
        return self.filter(deleted_at__isnull=True)


class Model(Scaling, models.Model):
    """A model people call by name through the gateway.

    Either it runs on the cluster (one or more profiles), or it is served by an external
    OpenAI-compatible provider (external_url, no profiles).
    """

    name = models.CharField(_("API name"), max_length=128, unique=True)
    # Deleted: no route serves it and its replicas are stopping; the row goes once they stopped.
    deleted_at = models.DateTimeField(_("deleted"), null=True, blank=True)
    organization = models.ForeignKey(
        Organization,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="models",
        verbose_name=_("owning organisation"),
    )
    team = models.ForeignKey(
        Team, on_delete=models.PROTECT, null=True, blank=True, related_name="models", verbose_name=_("owning team")
    )
    project = models.ForeignKey(
        Project,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="models",
        verbose_name=_("owning project"),
    )
    capacity_class = models.CharField(
        _("capacity class"), max_length=16, choices=CapacityClass.choices, blank=True, default=CapacityClass.UNSET
    )
    min_replicas = models.PositiveIntegerField(_("always-running replicas"), default=1)
    max_replicas = models.PositiveIntegerField(_("replicas under load"), default=1)
    source = models.CharField(
        _("weights on the nodes"),
        max_length=1000,
        blank=True,
        help_text=_("A path on the nodes: a .gguf file for llama.cpp, a directory for vLLM and SGLang."),
    )
    fallbacks = models.JSONField(
        _("fallbacks"), default=list, blank=True, help_text=_("Model names tried in order when this one cannot serve.")
    )
    external_url = models.URLField(_("external provider URL"), blank=True)
    external_model = models.CharField(_("provider's model name"), max_length=200, blank=True)
    external_api_key_file = models.CharField(_("provider key file"), max_length=1000, blank=True)
    # Set when the model's replicas were preempted: nothing is placed for it until then.
    held_until = models.DateTimeField(_("held back until"), null=True, blank=True)
    # The model whose minimum this one gave room up for: it is not placed again until that model's
    # replicas are (or held_until passes, so a preemptor that never fits cannot hold it for ever).
    held_for = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("held back for")
    )
    # A request arrived for a model kept at zero replicas: run one until then.
    demand_until = models.DateTimeField(_("wanted on demand until"), null=True, blank=True)
    # Scaling under load: the gateway marks when it last had to queue a request because every
    # replica's slots were taken; the reconciler steps `load_replicas` up towards the maximum
    # while that keeps happening and back down after a quiet spell.
    busy_at = models.DateTimeField(_("every replica last busy"), null=True, blank=True)
    load_replicas = models.PositiveIntegerField(_("replicas wanted for the load"), default=0)
    scaled_at = models.DateTimeField(_("last scaled for load"), null=True, blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    updated_at = models.DateTimeField(_("updated"), default=timezone.now)

    objects = ModelQuerySet.as_manager()

    class Meta:
        verbose_name = _("model")
        verbose_name_plural = _("models")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}
        if not MODEL_NAME.match(self.name or ""):
            errors.setdefault("name", []).append(
                str(_("Use 1 to 128 letters, digits and . _ : - starting with a letter or digit."))
            )
        if self.max_replicas < self.min_replicas:
            errors.setdefault("max_replicas", []).append(
                str(
                    _("Replicas under load (%(max)s) cannot be fewer than always-running replicas (%(min)s).")
                    % {"max": self.max_replicas, "min": self.min_replicas}
                )
            )
        if self.is_external and not self.external_model:
            errors.setdefault("external_model", []).append(str(_("Name the provider's model.")))
        if not self.is_external and self.external_model:
            errors.setdefault("external_url", []).append(str(_("Give the provider's URL too.")))
        if self.name and self.name in (self.fallbacks or []):
            errors.setdefault("fallbacks", []).append(str(_("A model cannot fall back to itself.")))
        if errors:
            raise ValidationError(errors)

    @property
    def is_external(self) -> bool:
        return bool(self.external_url)

    def owners(self) -> tuple[Any, Any, Any]:
        """(organisation, team, project) the model belongs to, each None where it has none; a
        project's team and a team's organisation are filled in when only the narrower is set."""
        project, team, org = self.project, self.team, self.organization
        if project is not None:
            team = team or project.team
        if team is not None:
            org = org or team.organization
        return org, team, project

    def owner_keys(self) -> tuple[str, ...]:
        """The capacity-quota keys this model's replicas count against, widest first."""
        keys: list[str] = []
        org, team, project = self.owners()
        if org is not None:
            keys.append(f"org:{org.pk}")
        if team is not None:
            keys.append(f"team:{team.pk}")
        if project is not None:
            keys.append(f"project:{project.pk}")
        return tuple(keys)


class Profile(models.Model):
    """One way to run a model: an engine on an accelerator with the resources it claims."""

    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="profiles", verbose_name=_("model"))
    name = models.CharField(_("name"), max_length=100)
    priority = models.IntegerField(_("priority"), default=0, help_text=_("The highest priority that fits wins."))
    engine = models.CharField(_("engine"), max_length=16, choices=Engine.choices, default=Engine.LLAMA_CPP)
    accelerator = models.CharField(
        _("accelerator"), max_length=64, default="cpu", help_text=_("A GPU class such as H100-80GB, or cpu.")
    )
    gpus_per_shard = models.PositiveIntegerField(_("GPUs per shard"), default=0)
    nodes_per_replica = models.PositiveIntegerField(_("nodes per replica"), default=1)
    parallel = models.PositiveIntegerField(_("parallel requests"), default=4)
    context_size = models.PositiveIntegerField(_("context size"), null=True, blank=True)
    memory_bytes = models.BigIntegerField(_("memory claim (bytes)"), default=0)
    cpu_cores = models.FloatField(_("CPU cores"), default=0)
    node_selector = models.JSONField(_("node labels required"), default=dict, blank=True)
    # What one shard draws, as the operator knows it (W); placement counts the highest of this, the
    # cards' TDP and what its cards were measured at against a rack's or PDU's power cap.
    power_watts = models.PositiveIntegerField(
        _("power per shard (W)"), null=True, blank=True, validators=[Declared("power_watts")]
    )
    # A replica across nodes is formed within one of these (its nodes' llmgw.io/<level> label); "" none.
    # The levels are facility's (its declaration of the field).
    keep_within = models.CharField(
        _("keep within"), max_length=8, blank=True, default="", validators=[Declared("keep_within")]
    )
    extra_args = models.JSONField(_("extra engine arguments"), default=list, blank=True)
    env = models.JSONField(_("extra environment"), default=dict, blank=True)
    # vLLM's --gpu-memory-utilization; None: vLLM's own default.
    gpu_memory_utilisation = models.FloatField(
        _("GPU memory share"),
        null=True,
        blank=True,
        help_text=_(GPU_MEMORY_UTILISATION.help),
        validators=[Declared(GPU_MEMORY_UTILISATION.name)],
    )

    class Meta:
        verbose_name = _("profile")
        verbose_name_plural = _("profiles")
        ordering = ["model__name", "-priority", "name"]
        constraints = [
            models.UniqueConstraint(fields=["model", "name"], name="%(app_label)s_%(class)s_unique_model_name"),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}/{self.name}"

    @property
    def is_cpu(self) -> bool:
        return self.accelerator.lower() == "cpu"

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}
        if self.is_cpu:
            if self.gpus_per_shard:
                errors.setdefault("gpus_per_shard", []).append(str(_("A CPU profile uses no GPUs.")))
            if not self.memory_bytes:  # on a change as on creation: an apply states the whole spec
                errors.setdefault("memory_bytes", []).append(
                    str(_("A CPU profile must declare the memory it needs, or placement would put it on any node."))
                )
        elif self.gpus_per_shard < 1:
            errors.setdefault("gpus_per_shard", []).append(
                str(
                    _("A %(accelerator)s profile needs at least one GPU per shard.") % {"accelerator": self.accelerator}
                )
            )
        if self.memory_bytes < 0:
            errors.setdefault("memory_bytes", []).append(str(_("Memory cannot be negative.")))
        if self.cpu_cores < 0:
            errors.setdefault("cpu_cores", []).append(str(_("CPU cores cannot be negative.")))
        if self.nodes_per_replica < 1:
            errors.setdefault("nodes_per_replica", []).append(str(_("A replica runs on at least one node.")))
        if self.parallel < 1:
            errors.setdefault("parallel", []).append(str(_("At least one request at a time.")))
        if not isinstance(self.node_selector, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.node_selector.items()
        ):
            errors.setdefault("node_selector", []).append(str(_("Expected a mapping of label names to values.")))
        if not isinstance(self.extra_args, list) or not all(isinstance(a, str) for a in self.extra_args):
            errors.setdefault("extra_args", []).append(str(_("Expected a list of strings.")))
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            errors.setdefault("env", []).append(str(_("Expected a mapping of names to values.")))
        if self.model_id and self.model.is_external:
            errors.setdefault("model", []).append(str(_("A model served by an external provider has no profiles.")))
        for name, problem in engine_problems(self).items():
            errors.setdefault(name, []).append(problem)
        if errors:
            raise ValidationError(errors)
