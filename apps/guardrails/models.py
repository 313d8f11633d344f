"""Guardrail policies and their rules (what apps.guardrails.engine applies).

A policy applies where it is attached: to every request (nothing attached), to an organisation,
a team, a project or a model. A request meets the policies of its key's organisation, team and
project and of its model, all of them, in that order (the nearest last, the model's own after
those); inside a policy its rules apply in their `order`.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from apps.guardrails import engine

KIND_CHOICES = [
    ("terms", _("blocked terms")),
    ("regex", _("regular expression")),
    ("detector", _("personal data or secret")),
    ("max_input_tokens", _("input token cap")),
    ("max_output_tokens", _("output token cap")),
    ("models", _("allowed models")),
    ("guard_model", _("a guard model's verdict")),
]
ACTION_CHOICES = [
    ("refuse", _("refuse")),
    ("redact", _("redact")),
    ("stop", _("stop the answer")),
    ("log", _("only log")),
]
DETECTOR_CHOICES = [
    ("email", _("e-mail addresses")),
    ("phone", _("phone numbers")),
    ("card", _("payment cards (Luhn-checked)")),
    ("iban", _("IBANs (checksum-checked)")),
    ("tckn", _("Turkish national ID numbers (checksum-checked)")),
    ("api_key", _("API keys and tokens of common shapes")),
    ("llmgw_key", _("llmgw's own keys")),
]
DIRECTION_CHOICES = [("both", _("prompt and answer")), ("input", _("prompt")), ("output", _("answer"))]
PROBLEM_FIELDS = {"terms": "terms", "regex": "pattern", "detector": "detector"}


def problem_text(problem: engine.PatternError) -> str:
    """Why a rule cannot run, in the current language."""
    return gettext(problem.template) % problem.params


class Policy(models.Model):
    name = models.CharField(_("name"), max_length=100, unique=True)
    description = models.TextField(_("description"), blank=True)
    enabled = models.BooleanField(_("enabled"), default=True)
    organization = models.ForeignKey(
        "accounts.Organization",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="policies",
        verbose_name=_("organisation"),
    )
    team = models.ForeignKey(
        "accounts.Team",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="policies",
        verbose_name=_("team"),
    )
    project = models.ForeignKey(
        "accounts.Project",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="policies",
        verbose_name=_("project"),
    )
    model = models.ForeignKey(
        "catalog.Model",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="policies",
        verbose_name=_("model"),
    )
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        verbose_name = _("guardrail policy")
        verbose_name_plural = _("guardrail policies")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def scope(self) -> tuple[str, str]:
        """Where it applies: ("everyone", ""), ("organisation", slug), ... ("model", name)."""
        if self.model is not None:
            return ("model", self.model.name)
        if self.project_id:
            return ("project", str(self.project))
        if self.team_id:
            return ("team", str(self.team))
        if self.organization_id:
            return ("organization", str(self.organization))
        return ("everyone", "")

    def clean(self) -> None:
        attached = [f for f in ("organization", "team", "project", "model") if getattr(self, f"{f}_id")]
        if len(attached) > 1:
            raise ValidationError(
                _("Attach a policy to one of organisation, team, project or model, not %(count)s of them.")
                % {"count": len(attached)}
            )


class Rule(models.Model):
    policy = models.ForeignKey(Policy, on_delete=models.CASCADE, related_name="rules", verbose_name=_("policy"))
    name = models.CharField(_("name"), max_length=100)
    order = models.PositiveIntegerField(_("order"), default=0)
    kind = models.CharField(_("kind"), max_length=20, choices=KIND_CHOICES)
    action = models.CharField(_("action"), max_length=10, choices=ACTION_CHOICES, default="refuse")
    applies_to = models.CharField(_("applies to"), max_length=8, choices=DIRECTION_CHOICES, default="both")
    terms = models.JSONField(_("terms"), default=list, blank=True, help_text=_("Words or phrases, matched whole."))
    pattern = models.TextField(_("regular expression"), blank=True)
    detector = models.CharField(_("detector"), max_length=20, choices=DETECTOR_CHOICES, blank=True)
    limit = models.PositiveIntegerField(_("limit"), null=True, blank=True, help_text=_("For a token cap."))
    model_names = models.JSONField(_("models"), default=list, blank=True, help_text=_("For allowed models."))
    fail_open = models.BooleanField(
        _("fail open"),
        default=False,
        help_text=_("For a guard model: let the request through when the model does not answer in time."),
    )
    enabled = models.BooleanField(_("enabled"), default=True)

    class Meta:
        verbose_name = _("guardrail rule")
        verbose_name_plural = _("guardrail rules")
        ordering = ["policy", "order", "pk"]
        constraints = [models.UniqueConstraint(fields=["policy", "name"], name="guardrails_rule_name_per_policy")]

    def __str__(self) -> str:
        return f"{self.policy.name}: {self.name}"

    def clean(self) -> None:
        errors = self._match_errors()
        if self.kind in ("max_input_tokens", "max_output_tokens", "models") and self.action not in ("refuse", "log"):
            errors["action"] = [str(_("A cap or a model list can refuse or only log."))]
        if self.kind == "guard_model" and self.action == "redact":
            errors["action"] = [str(_("A guard model's verdict can refuse, stop the answer or only log."))]
        if self.action == "stop" and self.applies_to == "input":
            errors["action"] = [str(_("Only an answer can be stopped; apply the rule to the answer."))]
        if errors:
            raise ValidationError(errors)

    def _match_errors(self) -> dict[str, list[str]]:
        """What the rule matches, checked: its terms, expression or detector (RE2 must run it), its
        cap or its models."""
        if self.kind == "terms" and (
            not isinstance(self.terms, list) or not [t for t in self.terms if isinstance(t, str) and t.strip()]
        ):
            return {"terms": [str(_("Give at least one term."))]}
        if self.kind == "detector" and (not isinstance(self.detector, str) or self.detector not in engine.DETECTORS):
            return {"detector": [str(_("Choose a detector."))]}
        if self.kind in PROBLEM_FIELDS:
            problem = self.problem()
            return {PROBLEM_FIELDS[self.kind]: [problem_text(problem)]} if problem is not None else {}
        if self.kind in ("max_input_tokens", "max_output_tokens") and not self.limit:
            return {"limit": [str(_("Give the most tokens allowed."))]}
        if self.kind == "models" and (
            not isinstance(self.model_names, list) or not all(isinstance(m, str) and m for m in self.model_names)
        ):
            return {"model_names": [str(_("Give the models allowed, by name."))]}
        if self.kind == "guard_model" and (
            not isinstance(self.model_names, list) or len(self.model_names) != 1 or not self.model_names[0]
        ):
            return {"model_names": [str(_("Name the one guard model to ask."))]}
        return {}

    def problem(self) -> engine.PatternError | None:
        """Why the rule cannot run (an expression RE2 refuses, saved before it was checked so), or None."""
        if self.kind == "regex":  # an empty expression too: it would match everywhere
            try:
                engine.check_pattern(self.pattern if isinstance(self.pattern, str) else "")
            except engine.PatternError as exc:
                return exc
            return None
        spec = engine.RuleSpec(
            policy="",
            name=self.name,
            kind=self.kind,
            action=self.action,
            terms=tuple(t for t in self.terms or () if isinstance(t, str)) if isinstance(self.terms, list) else (),
            detector=self.detector if isinstance(self.detector, str) else "",
        )
        return engine.rule_problem(spec)

    def spec(self) -> engine.RuleSpec:
        return engine.RuleSpec(
            policy=self.policy.name,
            name=self.name,
            kind=self.kind,
            action=self.action,
            terms=tuple(str(t) for t in self.terms or () if isinstance(t, str)),
            pattern=self.pattern,
            detector=self.detector,
            limit=self.limit,
            models=tuple(str(m) for m in self.model_names or ()),
            applies_to=self.applies_to,
            fail_open=self.fail_open,
        )
