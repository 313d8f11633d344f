"""Reading an API write's body through its serializer: one way for every view, so that the schema
declares each body with typed fields and a refusal has the API's error shape.

`read_body(SomeInput, request)` validates `request.data` with the serializer and answers its
validated data; a body it refuses is a ServiceError (400, code "invalid"), which the API's
exception handler renders as {"detail", "code", "errors"}: `errors` names each field as a path
(feeds[0].watts), `detail` is the serializer's own reason when it gives one for the whole body,
else the first field's "field: message".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.utils.translation import gettext
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.settings import api_settings

from llmgw.errors import ServiceError

__all__ = ["ServiceCheckedInput", "StrictCharField", "flat_errors", "read_body"]


class StrictCharField(serializers.CharField):
    """A string, and only a string: DRF's CharField takes 12 for "12", which a script that sent a
    number by mistake should hear about."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return str(super().to_internal_value(data))


class ServiceCheckedInput(serializers.Serializer[Any]):
    """A body whose fields are declared for the schema and checked by the service that takes it
    (the same check a file or the console gets, with the same words): its to_internal_value hands
    the body on, null included, once its own check passes."""

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        return False, data


def _path(prefix: str, key: str | int) -> str:
    if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)


def flat_errors(errors: Any, prefix: str = "") -> dict[str, list[str]]:
    """A serializer's nested errors as {path: [messages]}, the way the services name fields
    (models[0].name); the body's own errors (non_field_errors) under "" at the top."""
    out: dict[str, list[str]] = {}
    if isinstance(errors, Mapping):
        for key, value in errors.items():
            if key == api_settings.NON_FIELD_ERRORS_KEY:
                out.setdefault(prefix, []).extend(flat_errors(value, prefix).get(prefix, []))
                continue
            for path, messages in flat_errors(value, _path(prefix, key)).items():
                out.setdefault(path, []).extend(messages)
    elif isinstance(errors, list) and errors and all(isinstance(e, Mapping | list) for e in errors):
        for i, value in enumerate(errors):
            for path, messages in flat_errors(value, _path(prefix, i)).items():
                out.setdefault(path, []).extend(messages)
    elif isinstance(errors, list):
        out[prefix] = [str(e) for e in errors]
    else:
        out[prefix] = [str(errors)]
    return {path: messages for path, messages in out.items() if messages}


def read_body(
    serializer_class: type[serializers.Serializer[Any]],
    request: Request,
    *,
    detail: str | None = None,
    context: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of `request`, validated by `serializer_class`; refused (ServiceError, 400) with
    `detail` when given, else the serializer's reason, and each field's messages in `errors`."""
    serializer = serializer_class(data=request.data, context={"request": request, **(context or {})})
    if serializer.is_valid():
        return dict(serializer.validated_data)
    errors = flat_errors(serializer.errors)
    if detail is None:
        field, messages = next(iter(errors.items()), ("", [gettext("Invalid input.")]))
        detail = gettext("%(field)s: %(message)s") % {"field": field, "message": messages[0]} if field else messages[0]
    raise ServiceError(detail, details=errors, code="invalid")
