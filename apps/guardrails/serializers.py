"""What the guardrails API's writes accept: a policy, as apps.guardrails.services.set_policy takes it.

The fields are declared for the schema. Beyond the body being an object, the checking is the
service's own (names, scopes that must exist, each rule's fields as the model cleans them), so
that the API, the console and the CLI refuse a policy with the same words, field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _
from rest_framework import serializers
from rest_framework.settings import api_settings

from apps.guardrails.models import ACTION_CHOICES, DETECTOR_CHOICES, DIRECTION_CHOICES, KIND_CHOICES
from apps.guardrails.services import PolicyError
from llmgw.api_serializers import ServiceCheckedInput

__all__ = ["PolicyInput", "PolicyReplaceInput", "RuleInput"]


class RuleInput(serializers.Serializer[Any]):
    """One rule of a policy, in the order the rules are checked."""

    name = serializers.CharField(
        max_length=100, required=False, help_text=_("Unique in the policy; “rule N” when not given.")
    )
    kind = serializers.ChoiceField(choices=KIND_CHOICES, help_text=_("What the rule looks for."))
    action = serializers.ChoiceField(choices=ACTION_CHOICES, required=False, help_text=_("refuse when not given."))
    applies_to = serializers.ChoiceField(choices=DIRECTION_CHOICES, required=False, help_text=_("both when not given."))
    terms = serializers.ListField(
        child=serializers.CharField(), required=False, help_text=_("Words or phrases, matched whole.")
    )
    pattern = serializers.CharField(required=False, help_text=_("A regular expression (regex rules)."))
    detector = serializers.ChoiceField(choices=DETECTOR_CHOICES, required=False)
    limit = serializers.IntegerField(min_value=0, required=False, allow_null=True, help_text=_("For a token cap."))
    models = serializers.ListField(
        child=serializers.CharField(), required=False, help_text=_("For allowed models and guard models.")
    )
    fail_open = serializers.BooleanField(
        required=False,
        help_text=_("For a guard model: let the request through when the model does not answer in time."),
    )
    enabled = serializers.BooleanField(required=False, help_text=_("false: the rule is kept but not checked."))


class PolicyInput(ServiceCheckedInput):
    """A policy, whole: where it applies and its rules in order. One of that name is replaced."""

    name = serializers.CharField(max_length=100, help_text=_("The policy's name; one of that name is replaced."))
    description = serializers.CharField(required=False, allow_blank=True, help_text=_("What the policy is for."))
    enabled = serializers.BooleanField(required=False, help_text=_("true when not given."))
    organization = serializers.CharField(required=False, help_text=_("Attach it to an organization: its slug."))
    team = serializers.CharField(required=False, help_text=_("Or to a team: ORG/TEAM."))
    project = serializers.CharField(required=False, help_text=_("Or to a project: ORG/TEAM/PROJECT."))
    model = serializers.CharField(required=False, help_text=_("Or to a model: its name."))
    rules = RuleInput(many=True, required=False)

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        """The body as given, once it is an object; set_policy checks it field by field."""
        if not isinstance(data, Mapping):
            refused = self.context.get("not_an_object")
            if refused:
                raise serializers.ValidationError({api_settings.NON_FIELD_ERRORS_KEY: [str(refused)]})
            raise PolicyError({"": [gettext("a policy is a mapping: name, where it applies, rules")]})
        return dict(data)


class PolicyReplaceInput(PolicyInput):
    """A policy, whole, its name from the path: where it applies and its rules in order."""

    name = None  # type: ignore[assignment]
