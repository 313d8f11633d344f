"""What the facility API's writes accept."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext_lazy as _
from rest_framework import serializers

from apps.facility import power
from apps.facility.power import MAX_WATTS
from llmgw.api_serializers import ServiceCheckedInput, StrictCharField

__all__ = ["BudgetInput", "FeedInput"]


class FeedInput(serializers.Serializer[Any]):
    """One feed of an A/B-fed domain."""

    name = StrictCharField(required=False, help_text=_("A, B, ... in order when not given."))
    watts = serializers.IntegerField(min_value=1, max_value=MAX_WATTS)


class BudgetInput(ServiceCheckedInput):
    """One domain's power cap: as watts, or as the feeds that carry it."""

    # The fields are declared for the schema; the checking is the one server.yaml's budgets get
    # (apps.facility.power), so that the API, the console and the file refuse a budget alike.

    domain = StrictCharField(max_length=120, help_text=_("LEVEL=NAME, e.g. rack=r12"))
    watts = serializers.IntegerField(
        min_value=1, max_value=MAX_WATTS, required=False, help_text=_("The cap in whole watts.")
    )
    feeds = FeedInput(many=True, required=False, help_text=_("Or the feeds that carry the cap, each with its watts."))
    redundant = serializers.BooleanField(
        required=False, help_text=_("A/B-fed: the domain's cap is one feed, so that it survives losing the other.")
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        """The body as given, once power's own check takes it (BudgetError, with its words, if not)."""
        power._parse([data], "facility.budgets")
        return dict(data)
