"""The REST API refuses bad input with a clear 4xx, never a 500: page bounds on every list,
deep or non-standard JSON, text the database cannot store, and replica counts beyond reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.urls import get_resolver, reverse

from apps.catalog.models import Model
from apps.catalog.services import MAX_REPLICAS, SpecError, apply_models, apply_server_config
from llmgw.api import router
from llmgw.api_input import MAX_JSON_DEPTH

pytestmark = pytest.mark.django_db

SPEC = {
    "name": "qwen",
    "source": "/models/qwen.gguf",
    "replicas": {"min": 0, "max": 1},
    "profiles": [{"name": "cpu", "accelerator": "cpu", "memory": "2GB", "cpu_cores": 1}],
}


@pytest.fixture
def admin_api(api: Any, alice: Any, key_for: Any) -> Any:
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(alice)}")
    return api


def post_raw(api: Any, url: str, body: str) -> Any:
    return api.generic("POST", url, body.encode("utf-8", "surrogatepass"), content_type="application/json")


def spec(**changes: Any) -> dict[str, Any]:
    return {"models": [{**SPEC, **changes}]}


# Pages ---------------------------------------------------------------------------------------


def list_urls() -> list[str]:
    """Every list endpoint of the router, so that a new collection is checked without a word here."""
    get_resolver().url_patterns  # noqa: B018 (the URLconf fills the router as it is imported)
    return [reverse(f"{basename}-list") for _prefix, viewset, basename in router.registry if hasattr(viewset, "list")]


def test_every_collection_is_listed() -> None:
    urls = list_urls()
    assert "/api/v1/audit" in urls and "/api/v1/keys" in urls and len(urls) >= 10


@pytest.mark.parametrize(
    "query, name",
    [
        ("limit=9223372036854775808", "limit"),
        ("limit=99999999999999999999999", "limit"),
        ("limit=-1", "limit"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("limit=1.5", "limit"),
        ("limit=", "limit"),
        ("limit=%EF%BC%95", "limit"),  # a full-width digit five
        ("offset=9223372036854775808", "offset"),
        ("offset=-1", "offset"),
        ("offset=x", "offset"),
        ("offset=2147483648", "offset"),
    ],
)
def test_a_page_out_of_bounds_is_a_400_naming_the_parameter_and_its_bounds(
    admin_api: Any, query: str, name: str
) -> None:
    for url in list_urls():
        response = admin_api.get(f"{url}?{query}")
        assert response.status_code == 400, (url, query, response.content)
        errors = response.json()["errors"]
        low, high = ("1", "1000") if name == "limit" else ("0", "2147483647")
        assert list(errors) == [name] and f"from {low} to {high}" in errors[name][0], (url, errors)


def test_pages_within_bounds_are_served(admin_api: Any) -> None:
    for url in list_urls():
        for query in ("limit=1000", "limit=1&offset=0", "offset=2147483647", "limit=7&offset=3"):
            response = admin_api.get(f"{url}?{query}")
            assert response.status_code == 200, (url, query, response.content)
    assert len(admin_api.get("/api/v1/audit?limit=1").json()["results"]) == 1


def test_the_schema_states_the_page_bounds(api: Any) -> None:
    schema = api.get("/api/v1/schema?format=json").json()
    parameters = {p["name"]: p["schema"] for p in schema["paths"]["/api/v1/nodes/"]["get"]["parameters"]}
    assert parameters["limit"] == {"type": "integer", "minimum": 1, "maximum": 1000}
    assert parameters["offset"] == {"type": "integer", "minimum": 0, "maximum": 2147483647}


# JSON bodies -----------------------------------------------------------------------------------


def nested(depth: int) -> str:
    """An object holding arrays in arrays: `depth` levels in all."""
    text = '{"models": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    return text


@pytest.mark.parametrize("depth", [2000, 100_000])
def test_deeply_nested_json_is_a_400(admin_api: Any, depth: int) -> None:
    for url in ("/api/v1/models/apply", "/api/v1/keys", "/api/v1/limits", "/api/v1/nodes/enrollments"):
        response = post_raw(admin_api, url, nested(depth))
        assert response.status_code == 400, (url, response.content)
        assert f"deeper than {MAX_JSON_DEPTH} levels" in response.json()["detail"]


def test_json_as_deep_as_the_bound_is_read(admin_api: Any) -> None:
    assert "deeper" in post_raw(admin_api, "/api/v1/models/apply", nested(MAX_JSON_DEPTH + 1)).json()["detail"]
    answer = post_raw(admin_api, "/api/v1/models/apply", nested(MAX_JSON_DEPTH)).json()
    assert answer["detail"] == "Invalid model spec."  # read, then refused as a spec


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_numbers_json_does_not_have_are_a_400(admin_api: Any, constant: str) -> None:
    response = post_raw(admin_api, "/api/v1/models/qwen/resources", '{"cores": ' + constant + "}")
    assert response.status_code == 400, response.content
    assert "not valid JSON" in response.json()["detail"]


@pytest.mark.parametrize(
    "body, field",
    [
        ('{"name": "ci\\ud800"}', "name"),
        ('{"name": "ci", "allowed_models": ["a", "\\udfff"]}', "allowed_models[1]"),
        ('{"name": "ci", "\\ud800": 1}', "\\ud800"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(admin_api: Any, body: str, field: str) -> None:
    response = post_raw(admin_api, "/api/v1/keys", body)
    assert response.status_code == 400, response.content
    answer = response.json()
    assert answer["detail"].startswith(f"{field}: ") and "lone UTF-16 surrogate" in answer["detail"]
    assert list(answer["errors"]) == [field]


def test_a_surrogate_pair_is_text(admin_api: Any) -> None:
    response = post_raw(admin_api, "/api/v1/keys", '{"name": "ci \\ud83d\\ude80"}')
    assert response.status_code == 201, response.content
    assert response.json()["name"] == "ci \N{ROCKET}"


def test_a_body_that_is_not_json_is_refused(admin_api: Any) -> None:
    assert post_raw(admin_api, "/api/v1/keys", '{"name": ').status_code == 400
    response = admin_api.generic("POST", "/api/v1/keys", b"name=ci", content_type="application/x-www-form-urlencoded")
    assert response.status_code == 415
    response = admin_api.generic("POST", "/api/v1/keys", b'{"name": "\xff"}', content_type="application/json")
    assert response.status_code == 400 and "UTF-8" in response.json()["detail"].upper()


# NUL characters ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, body, field",
    [
        ("/api/v1/models/apply", spec(name="q\x00"), "models[0].name"),
        ("/api/v1/models/apply", spec(source="/m\x00.gguf"), "models[0].source"),
        (
            "/api/v1/models/apply",
            spec(profiles=[{**SPEC["profiles"][0], "env": {"A": "\x00"}}]),
            "models[0].profiles[0].env.A",
        ),
        ("/api/v1/models/apply", spec(owner={"organization": "\x00"}), "models[0].owner.organization"),
        ("/api/v1/keys", {"name": "ci\x00"}, "name"),
        ("/api/v1/keys", {"name": "ci", "allowed_models": ["\x00"]}, "allowed_models[0]"),
        ("/api/v1/nodes/enrollments", {"name": "gpu1", "labels": {"rack\x00": "r1"}}, "labels.rack\\x00"),
        ("/api/v1/nodes/enrollments", {"name": "gpu1", "labels": {"rack": "r\x001"}}, "labels.rack"),
        ("/api/v1/organizations", {"name": "Acme\x00"}, "name"),
    ],
)
def test_a_nul_character_in_a_write_is_a_400_naming_the_field(
    admin_api: Any, url: str, body: dict[str, Any], field: str
) -> None:
    response = admin_api.post(url, body, format="json")
    assert response.status_code == 400, response.content
    answer = response.json()
    assert field in answer["errors"], answer
    assert "NUL" in " ".join(answer["errors"][field]) and "NUL" in answer["detail"]
    assert not Model.objects.exists()


def test_the_spec_validation_refuses_nul_and_lone_surrogates_from_any_source(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as error:
        apply_models([{**SPEC, "name": "q\x00"}, {**SPEC, "name": "r", "fallbacks": ["\ud800"]}], actor=None)
    assert "NUL" in error.value.errors["models[0].name"][0]
    assert "surrogate" in error.value.errors["models[1].fallbacks[0]"][0]
    path = tmp_path / "server.yaml"
    path.write_text(
        'models:\n  - name: "q\\0"\n    source: /m.gguf\n    profiles: [{name: cpu, accelerator: cpu, memory: 1GB}]\n'
    )
    with pytest.raises(SpecError) as error:
        apply_server_config(str(path))
    assert list(error.value.errors) == ["models[0].name"]
    assert not Model.objects.exists()


# Replica counts and resources --------------------------------------------------------------------


@pytest.mark.parametrize(
    "replicas", [MAX_REPLICAS + 1, {"min": 0, "max": MAX_REPLICAS + 1}, {"min": 2**63, "max": 2**63}, {"min": 1025}]
)
def test_a_spec_asking_for_too_many_replicas_is_a_400_with_the_bound(admin_api: Any, replicas: Any) -> None:
    response = admin_api.post("/api/v1/models/apply", spec(replicas=replicas), format="json")
    assert response.status_code == 400, response.content
    assert any(f"At most {MAX_REPLICAS} replicas" in m for m in response.json()["errors"]["models[0].replicas"])
    assert not Model.objects.exists()


def test_a_spec_at_the_bound_is_applied(admin_api: Any) -> None:
    response = admin_api.post("/api/v1/models/apply", spec(replicas={"min": 0, "max": MAX_REPLICAS}), format="json")
    assert response.status_code == 200, response.content
    assert Model.objects.get().max_replicas == MAX_REPLICAS


@pytest.fixture
def qwen(alice: Any) -> Model:
    apply_models([SPEC], actor=alice)
    return Model.objects.get(name="qwen")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"max": MAX_REPLICAS + 1}, "max"),
        ({"min": 2**63}, "min"),
        ({"max": -1}, "max"),
        ({"min": "many"}, "min"),
    ],
)
def test_a_target_out_of_bounds_is_a_400(admin_api: Any, qwen: Model, body: dict[str, Any], field: str) -> None:
    response = admin_api.post("/api/v1/models/qwen/target", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["errors"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"cores": "inf"}, "cores"),
        ({"cores": 10**6}, "cores"),
        ({"cores": -1}, "cores"),
        ({"memory": "9" * 400 + "TB"}, "memory"),
        ({"memory": "9" * 30 + "TB"}, "memory"),
        ({"memory": "1e9GB"}, "memory"),
        ({"memory": "x" * 33}, "memory"),
    ],
)
def test_resources_out_of_bounds_are_a_400(admin_api: Any, qwen: Model, body: dict[str, Any], field: str) -> None:
    response = admin_api.post("/api/v1/models/qwen/resources", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["errors"]


def test_a_spec_with_impossible_cores_or_memory_is_refused_with_the_field() -> None:
    with pytest.raises(SpecError) as error:
        apply_models(
            [{**SPEC, "profiles": [{"name": "cpu", "memory": float("inf"), "cpu_cores": float("inf")}]}], actor=None
        )
    assert set(error.value.errors) >= {"models[0].profiles[0].memory", "models[0].profiles[0].cpu_cores"}
    assert "4096" in error.value.errors["models[0].profiles[0].cpu_cores"][0]


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"replicas": {"min": "two"}}, "models[0].replicas"),
        ({"replicas": {"min": [1]}}, "models[0].replicas"),
        ({"profiles": [{**SPEC["profiles"][0], "priority": 2**64}]}, "models[0].profiles[0].priority"),
        ({"profiles": [{**SPEC["profiles"][0], "priority": 2**31}]}, "models[0].profiles[0].priority"),
        ({"profiles": [{**SPEC["profiles"][0], "context_size": 2**40}]}, "models[0].profiles[0].context_size"),
        ({"profiles": [{**SPEC["profiles"][0], "parallel": -1}]}, "models[0].profiles[0].parallel"),
        ({"profiles": [{**SPEC["profiles"][0], "memory": 2**70}]}, "models[0].profiles[0].memory"),
        ({"name": "q" * 500}, "models[0].name"),
    ],
)
def test_a_spec_with_values_the_database_cannot_hold_is_a_400(
    admin_api: Any, changes: dict[str, Any], field: str
) -> None:
    response = admin_api.post("/api/v1/models/apply", spec(**changes), format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["errors"], response.json()
