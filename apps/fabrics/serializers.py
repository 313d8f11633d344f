"""What the fabric API's writes accept."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from rest_framework import serializers

from apps.cluster.models import Node
from llmgw.api_serializers import StrictCharField

__all__ = ["FabricTestInput"]


class FabricTestInput(serializers.Serializer[Any]):
    """Two different nodes that share a fabric, and how long to measure each rail."""

    a = StrictCharField(
        max_length=255, required=False, default="", help_text=gettext_lazy("The client node's name (it sends).")
    )
    b = StrictCharField(
        max_length=255, required=False, default="", help_text=gettext_lazy("The server node's name (it receives).")
    )
    duration = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=5,
        help_text=gettext_lazy("Seconds per rail, 1 to 60 (5 when not given)."),
        error_messages={
            "invalid": gettext_lazy("1 to 60 seconds per rail."),
            "max_value": gettext_lazy("1 to 60 seconds per rail."),
            "min_value": gettext_lazy("1 to 60 seconds per rail."),
            "max_string_length": gettext_lazy("1 to 60 seconds per rail."),
        },
        min_value=1,
        max_value=60,
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        names = [attrs["a"], attrs["b"]]
        nodes = {n.name: n for n in Node.objects.filter(name__in=names)}
        missing = [n for n in names if n not in nodes]
        if missing or names[0] == names[1]:
            raise serializers.ValidationError(
                _("Name two different nodes (unknown: %(names)s).") % {"names": ", ".join(missing) or "-"}
            )
        return {**attrs, "duration": attrs["duration"] or 5, "client": nodes[names[0]], "server": nodes[names[1]]}
