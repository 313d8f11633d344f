"""The model card and its pages as an operator reads them: owner, measured figures, titles, the
Declare form."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.models import AuditEvent, Organization, Project, Team
from apps.catalog.models import Model
from tests.builders import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def cell(html: str, replica: int, column: str) -> str:
    found = re.search(rf'<tr data-replica="{replica}">.*?<td data-col="{column}">(.*?)</td>', html, re.S)
    assert found is not None, f"no {column} for replica {replica}"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_a_replicas_measured_memory_and_cores_read_with_their_precision(client: Client, alice) -> None:
    node = make_node("cpu-01", memory_gb=64)
    model = make_model("qwen", memory_gb=1, cores=1)
    replica = make_replica(model, node)
    shard = replica.shards.get()
    node.sample = {
        **node.sample,
        "shards": [{"shard": shard.shard_id, "cpu_cores": 0.02, "memory_bytes": 19 * 1024**2}],
    }
    node.sampled_at = timezone.now()
    node.save(update_fields=["sample", "sampled_at"])
    client.force_login(alice)
    html = client.get("/models/qwen/").content.decode()
    assert cell(html, replica.pk, "memory") == "19 MiB of 1.0 GiB"
    assert cell(html, replica.pk, "cpu") == "0.02 of 1.0"


def test_the_explain_title_says_why_a_model_does_not_run_when_it_runs_nowhere(client: Client, alice) -> None:
    make_node("cpu-01", memory_gb=4)
    model = make_model("huge", memory_gb=100, cores=1)
    client.force_login(alice)
    html = client.get("/models/huge/explain").content.decode()
    assert "<title>Why huge does not run" in html and "runs where it does" not in html
    make_replica(model, make_node("cpu-02", memory_gb=512))
    assert "Why huge runs where it does" in client.get("/models/huge/explain").content.decode()


def test_the_declare_form_starts_empty_with_the_example_as_its_placeholder(client: Client, alice) -> None:
    client.force_login(alice)
    html = client.get("/models/apply").content.decode()
    textarea = re.search(r'<textarea[^>]*id="spec"[^>]*>(.*?)</textarea>', html, re.S)
    assert textarea is not None and textarea.group(1) == ""
    assert 'placeholder="models:' in html
    answer = client.post("/models/apply", {"spec": "   \n"})
    assert "Nothing to declare" in answer.content.decode()
    assert not Model.objects.exists()


def test_the_owner_is_set_on_the_card_its_parents_follow_and_the_change_is_audited(
    client: Client, alice, viola
) -> None:
    org = Organization.objects.create(name="Acme", slug="acme")
    team = Team.objects.create(organization=org, name="Vision", slug="vision")
    project = Project.objects.create(team=team, name="Captions", slug="captions")
    model = make_model("qwen", memory_gb=1, cores=1, replicas=0)
    client.force_login(alice)
    html = client.get("/models/qwen/").content.decode()
    assert 'data-form="owner"' in html and "Acme / Vision / Captions" in html
    answer = client.post("/models/qwen/owner", {"owner": f"project:{project.pk}"}, headers={"HX-Request": "true"})
    assert answer.status_code == 200 and "qwen now belongs to Acme / Vision / Captions" in answer.content.decode()
    model.refresh_from_db()
    assert (model.organization, model.team, model.project) == (org, team, project)
    assert model.owner_keys() == (f"org:{org.pk}", f"team:{team.pk}", f"project:{project.pk}")
    event = AuditEvent.objects.get(action="model.owner")
    assert event.changes["project"] == [None, project.pk]
    client.post("/models/qwen/owner", {"owner": ""})
    model.refresh_from_db()
    assert (model.organization, model.team, model.project) == (None, None, None)
    # A choice that is not offered changes nothing and says why.
    answer = client.post("/models/qwen/owner", {"owner": "team:999999"}, headers={"HX-Request": "true"})
    assert 'data-error="owner"' in answer.content.decode()
    # A viewer may not.
    client.force_login(viola)
    assert client.post("/models/qwen/owner", {"owner": f"org:{org.pk}"}).status_code == 403
    model.refresh_from_db()
    assert model.organization is None


@pytest.mark.parametrize("language", ["tr", "en"])
def test_number_fields_hold_numbers_a_browser_reads_in_every_language(client: Client, alice, language: str) -> None:
    """A Turkish page writes 1,5 for one and a half; a number input's value must stay 1.5."""
    make_model("qwen", memory_gb=1, cores=1.5)
    client.force_login(alice)
    client.cookies["django_language"] = language
    for path in ("/models/qwen/", "/nodes/add/"):
        html = client.get(path, HTTP_ACCEPT_LANGUAGE=language).content.decode()
        for tag in re.findall(r'<input[^>]*type="number"[^>]*>', html):
            value = re.search(r'value="([^"]*)"', tag)
            if value and value.group(1):
                assert re.fullmatch(r"-?\d+(\.\d+)?", value.group(1)), f"{path}: {tag}"
    assert 'value="1.5"' in client.get("/models/qwen/").content.decode()
