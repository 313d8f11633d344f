"""A service's refusal (llmgw.errors.ServiceError) reaches an API client as the error body, with its
status and code, and a console page as its error message; the refusals that were there before keep
their status and their words."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from apps.accounts.choices import StaffRole
from apps.batches.services import BatchRefused
from apps.catalog import services as catalog
from apps.cluster import agent_requests, engines, enrolment
from apps.fabrics import perf
from apps.facility import power
from apps.facility import services as facility
from apps.guardrails.services import PolicyError
from apps.mirror import hub
from apps.sim import runs, scenario
from llmgw.errors import ServiceError, refusal_message
from tests.conftest import make_user

SPEC = {
    "name": "tiny",
    "source": "/models/tiny.gguf",
    "replicas": 1,
    "profiles": [{"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "cpu_cores": 1}],
}


@pytest.fixture
def operator(db: Any) -> Any:
    return make_user("olga@example.com", role=StaffRole.OPERATOR, name="Olga")


@pytest.fixture
def page(client: Client, operator: Any) -> Client:
    client.force_login(operator)
    return client


@pytest.fixture
def api(api: Any, operator: Any) -> Any:
    api.force_authenticate(operator)
    return api


def test_a_refusal_is_a_bad_request_named_refused_unless_it_says_otherwise() -> None:
    plain = ServiceError("No.")
    assert (str(plain), plain.message, plain.status, plain.code, plain.details) == ("No.", "No.", 400, "refused", None)
    told = ServiceError("Busy.", status=409, code="busy", details={"line": 3})
    assert (told.status, told.code, told.details) == (409, "busy", {"line": 3})
    assert ServiceError.status == 400 and ServiceError.code == "refused"  # the class is untouched


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        (catalog.SpecError, 400, "spec_invalid"),
        (facility.HoldError, 400, "hold_refused"),
        (power.BudgetError, 400, "budget_invalid"),
        (scenario.ScenarioError, 400, "scenario_invalid"),
        (PolicyError, 400, "policy_invalid"),
        (perf.TestRefused, 409, "fabric_test_refused"),
        (hub.MirrorError, 400, "mirror_refused"),
        (hub.HubNotFound, 404, "hub_not_found"),
        (engines.EngineConfigError, 400, "engine_config_invalid"),
        (enrolment.EnrollmentRefused, 403, "enrollment_refused"),
        (agent_requests.RequestRefused, 409, "agent_request_refused"),
        (runs.TooManyRuns, 429, "too_many_runs"),
    ],
)
def test_each_services_refusal_is_a_service_error_with_its_status_and_code(kind: Any, status: int, code: str) -> None:
    assert issubclass(kind, ServiceError) and (kind.status, kind.code) == (status, code)


def test_the_refusals_that_were_value_errors_still_are() -> None:
    for kind in (facility.HoldError, power.BudgetError, scenario.ScenarioError, PolicyError, perf.TestRefused):
        assert issubclass(kind, ValueError)
    for kind in (hub.MirrorError, engines.EngineConfigError, agent_requests.RequestRefused):
        assert issubclass(kind, ValueError)


def test_a_batch_refusal_keeps_its_own_status_and_the_code_the_batch_apis_give() -> None:
    ended = BatchRefused(409, "Cannot cancel a batch that is completed.", code="batch_ended")
    assert (ended.status, ended.code, ended.kind) == (409, "batch_ended", "invalid_request_error")
    assert ended.message == str(ended) == "Cannot cancel a batch that is completed."
    assert BatchRefused(400, "The body must be a JSON object.").code is None  # the OpenAI body says null


def test_a_page_shows_the_fields_messages_or_else_the_message() -> None:
    assert refusal_message(power.BudgetError({"domain": ["rack=r1 has no power cap."]})) == "rack=r1 has no power cap."
    assert refusal_message(ServiceError("Too old.", details={"line": 3})) == "Too old."


def test_a_service_error_reaches_an_api_client_as_the_error_body(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ServiceError("The spec is locked while a rollout runs.", status=409, code="locked", details={"line": 3})

    monkeypatch.setattr(catalog, "apply_models", refuse)
    answer = api.post("/api/v1/models/apply", {"models": [SPEC]}, format="json")
    assert answer.status_code == 409
    assert answer.json() == {
        "detail": "The spec is locked while a rollout runs.",
        "code": "locked",
        "errors": {"line": 3},
    }


def test_a_bad_model_spec_keeps_its_status_and_words_and_gains_a_code(api: Any) -> None:
    answer = api.post("/api/v1/models/apply", {"models": [{**SPEC, "replicas": "many"}]}, format="json")
    assert answer.status_code == 400
    body = answer.json()
    assert (body["detail"], body["code"]) == ("Invalid model spec.", "spec_invalid")
    assert "models[0].replicas" in body["errors"]


def test_a_refused_hold_keeps_its_status_and_words(api: Any) -> None:
    assert api.post("/api/v1/facility/holds", {"domain": "rack=r12"}, format="json").status_code == 201
    again = api.post("/api/v1/facility/holds", {"domain": "rack=r12"}, format="json")
    assert again.status_code == 400
    assert again.json() == {"detail": "rack=r12 is already held", "code": "hold_refused"}
    assert api.post("/api/v1/facility/holds", {"domain": "shelf=3"}, format="json").status_code == 400


def test_a_refused_budget_names_its_fields_and_its_code(api: Any) -> None:
    answer = api.post("/api/v1/facility/budgets", {"domain": "rack=r12", "watts": "lots"}, format="json")
    assert answer.status_code == 400
    body = answer.json()
    assert body["code"] == "budget_invalid" and body["errors"]
    assert body["detail"] == "; ".join(f"{field}: {' '.join(found)}" for field, found in body["errors"].items())


def test_an_unknown_enrollment_token_is_still_forbidden(client: Client, db: Any) -> None:
    answer = client.post("/api/v1/agent/enroll", {"token": "llmgwe_nothing"}, content_type="application/json")
    assert answer.status_code == 403
    assert answer.json() == {"detail": "Unknown enrollment token.", "code": "enrollment_refused"}


def test_too_many_simulations_is_still_a_429(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise runs.TooManyRuns("You have 3 simulations queued or running.")

    monkeypatch.setattr(runs, "ask", refuse)
    answer = api.post("/api/v1/sim", {"scenario": "nodes: []"}, format="json")
    assert answer.status_code == 429
    assert answer.json() == {"detail": "You have 3 simulations queued or running.", "code": "too_many_runs"}


def test_a_console_page_shows_the_refusals_message(page: Client) -> None:
    assert page.post("/facility/hold", {"level": "rack", "name": "r12"}).status_code == 302
    again = page.post("/facility/hold", {"level": "rack", "name": "r12"}, follow=True)
    assert "rack=r12 is already held" in again.content.decode()
    bad = page.post("/facility/budget/remove", {"domain": "rack=r12"}, follow=True).content.decode()
    assert "rack=r12 has no power cap." in bad and "domain: rack=r12" not in bad  # the messages, not the fields


def test_a_service_error_raised_under_a_console_view_is_its_error_message(
    page: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise engines.EngineConfigError("version: “b9 b10” is not a release tag.")

    monkeypatch.setattr(engines, "set_choice", refuse)
    answer = page.post("/cluster/engines/set", {"engine": "llama.cpp", "version": "b9 b10"}, follow=True)
    assert "is not a release tag." in answer.content.decode()
