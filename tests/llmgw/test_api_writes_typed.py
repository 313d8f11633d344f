"""Every API write declares its body with typed fields, so that the schema tells a script what to
send and a new write that reads request.data by hand, undeclared, fails here; and the writes that
read their bodies through a serializer refuse with the API's error body and the words they had.

The schema is generated once for the module (as /api/v1/schema serves it); each test walks it.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client, override_settings
from drf_spectacular.generators import SchemaGenerator

from apps.accounts.choices import StaffRole
from apps.cluster.models import Node
from apps.guardrails.models import Policy
from llmgw.api_serializers import flat_errors
from tests.conftest import make_user

WRITES = ("post", "put", "patch")

# Writes that take no body, on purpose: the path names all there is to do. Each reason is why.
NO_BODY = {
    ("post", "/api/v1/agent-requests/{id}/retry"): "sends the named failed agent request again, as it was",
    ("post", "/api/v1/batches/{id}/cancel/"): "cancels the named batch",
    ("post", "/api/v1/engines/refresh"): "looks up the engines' releases again",
    ("post", "/api/v1/fabrics/{fabric}/topology"): "asks a node on the named fabric to map it now",
    ("post", "/api/v1/keys/{id}/revoke/"): "revokes the named key",
    ("post", "/api/v1/nodes/{name}/revoke/"): "revokes the named node's credential",
    ("post", "/api/v1/nodes/{name}/uncordon/"): "lets the scheduler place on the named node again",
}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    with override_settings(LANGUAGE_CODE="en-us"):
        generated: dict[str, Any] = SchemaGenerator().get_schema(request=None, public=True)
    return generated


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _typed(schema: dict[str, Any], prop: dict[str, Any]) -> bool:
    """A property says what it is: a type, an enum or a component (directly or through allOf/oneOf)."""
    if "type" in prop or "enum" in prop or "$ref" in prop:
        return True
    variants = prop.get("allOf") or prop.get("oneOf") or prop.get("anyOf") or []
    return bool(variants) and all(_typed(schema, v) for v in variants)


def _writes(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        if method in WRITES
    ]


def test_every_write_declares_a_body_of_typed_fields(schema: dict[str, Any]) -> None:
    untyped = []
    for method, path, operation in _writes(schema):
        if (method, path) in NO_BODY:
            continue
        body = operation.get("requestBody")
        if body is None:
            untyped.append(f"{method.upper()} {path}: no request body declared")
            continue
        declared = body["content"].get("application/json")
        if declared is None:
            untyped.append(f"{method.upper()} {path}: no JSON body declared")
            continue
        shape = _resolve(schema, declared["schema"])
        properties = shape.get("properties") or {}
        if shape.get("type") != "object" or not properties:
            untyped.append(f"{method.upper()} {path}: the body is a free-form object, with no fields")
            continue
        loose = sorted(name for name, prop in properties.items() if not _typed(schema, prop))
        if loose:
            untyped.append(f"{method.upper()} {path}: fields without a type: {', '.join(loose)}")
    assert untyped == [], "declare these bodies with a serializer (@extend_schema(request=...)):\n" + "\n".join(untyped)


def test_the_writes_that_take_no_body_still_take_none(schema: dict[str, Any]) -> None:
    """The list above stays true: each is still a write of the API, and still without a body."""
    found = {(method, path): operation for method, path, operation in _writes(schema)}
    assert sorted(set(NO_BODY) - set(found)) == []
    assert sorted(key for key in NO_BODY if "requestBody" in found[key]) == []


def test_a_serializer_s_nested_errors_are_named_as_paths() -> None:
    errors = {"domain": ["d"], "feeds": [{}, {"watts": ["w"]}], "non_field_errors": ["whole"]}
    assert flat_errors(errors) == {"domain": ["d"], "feeds[1].watts": ["w"], "": ["whole"]}


# The bodies read through a serializer: their refusals ---------------------------------------------


@pytest.fixture
def admin_api(api: Any, db: Any) -> Any:
    api.force_authenticate(make_user("ada@example.com", role=StaffRole.ADMIN))
    return api


@pytest.mark.parametrize(
    ("body", "detail", "errors"),
    [
        ({"a": "n1", "b": "nowhere"}, "Name two different nodes (unknown: nowhere).", {"": [...]}),
        ({"a": "n1", "b": "n1"}, "Name two different nodes (unknown: -).", {"": [...]}),
        ({"a": "n1", "b": "n2", "duration": 61}, "duration: 1 to 60 seconds per rail.", {"duration": [...]}),
        ({"a": "n1", "b": "n2", "duration": "soon"}, "duration: 1 to 60 seconds per rail.", {"duration": [...]}),
        ({"a": 7, "b": "n2"}, "a: Not a valid string.", {"a": [...]}),
    ],
)
def test_a_fabric_test_is_refused_with_the_reason(
    admin_api: Any, body: dict[str, Any], detail: str, errors: dict[str, Any]
) -> None:
    for name in ("n1", "n2"):
        Node.objects.create(name=name)
    answer = admin_api.post("/api/v1/fabric-tests", body, format="json")
    assert answer.status_code == 400
    assert (answer.json()["detail"], answer.json()["code"]) == (detail, "invalid")
    assert answer.json()["errors"].keys() == errors.keys()


def test_a_policy_that_is_not_an_object_is_refused_with_the_words_it_had(admin_api: Any) -> None:
    put = admin_api.put("/api/v1/guardrails/pii", ["not", "a", "policy"], format="json")
    assert put.status_code == 400
    assert put.json() == {
        "detail": "A policy is a JSON object: its fields and rules.",
        "code": "invalid",
        "errors": {"": ["A policy is a JSON object: its fields and rules."]},
    }
    post = admin_api.post("/api/v1/guardrails", "null", content_type="application/json")
    assert post.status_code == 400
    assert post.json()["code"] == "policy_invalid"
    assert post.json()["detail"] == "a policy is a mapping: name, where it applies, rules"
    unknown = admin_api.post("/api/v1/guardrails", {"name": "p", "colour": "red"}, format="json")
    assert unknown.status_code == 400 and "unknown field colour" in unknown.json()["errors"][""][0]
    assert not Policy.objects.exists()


def test_a_budget_or_a_model_spec_that_is_null_is_refused_by_its_service(admin_api: Any) -> None:
    budget = admin_api.post("/api/v1/facility/budgets", "null", content_type="application/json")
    assert budget.status_code == 400 and budget.json()["code"] == "budget_invalid"
    assert list(budget.json()["errors"]) == ["facility.budgets[0]"]
    specs = admin_api.post("/api/v1/models/apply", "null", content_type="application/json")
    assert specs.status_code == 400 and specs.json()["errors"] == {"models": ["Expected a list of models."]}


@pytest.mark.parametrize("body", [{}, {"token": ""}, {"token": 5}, {"token": None}, ["llmgwe_x"]])
def test_an_enrollment_without_a_token_string_is_told_how_to_send_it(db: Any, body: Any) -> None:
    answer = Client().post("/api/v1/agent/enroll", body, content_type="application/json")
    assert answer.status_code == 400
    assert answer.json()["detail"] == 'Send the enrollment token as {"token": "llmgwe_..."}.'
    assert answer.json()["code"] == "invalid"
