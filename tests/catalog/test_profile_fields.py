"""A profile's fields, declared once (apps.catalog.profile_fields): a GPU memory share from a model
file or the API to vLLM's command line, refused with the number where it is out of range; and the
declarations behind the spec reader, the API, the admin, placement and the simulator's copy."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.test import RequestFactory

from agent.engines import vllm
from agent.protocol import DesiredShard
from apps.catalog import profile_fields
from apps.catalog import services as catalog
from apps.catalog.extensions import EXTENSIONS as CATALOG
from apps.catalog.models import Profile
from apps.cluster.decisions import RUNNING_FIELDS, profile_spec, running_spec
from apps.cluster.model_api import ProfileSerializer
from apps.cluster.models import Replica
from apps.cluster.placement import REGISTRY, ProfileField
from apps.cluster.reconciler import desired_shards, reconcile
from apps.sim.store import SimProfile
from tests.builders import H100, make_node
from tests.conftest import make_user

pytestmark = pytest.mark.django_db

FIELD = "models[0].profiles[0].gpu_memory_utilisation"


def spec(**profile: Any) -> dict[str, Any]:
    return {
        "name": "big",
        "source": "/models/big",
        "profiles": [{"name": "h100", "engine": "vllm", "accelerator": H100, "gpus_per_shard": 1, **profile}],
    }


def command(shard: dict[str, Any]) -> list[str]:
    argv, _env = vllm.build_command(DesiredShard.parse(shard), "vllm")
    return argv


def test_a_gpu_memory_share_in_a_model_file_reaches_vllms_command_line() -> None:
    node = make_node(gpus=1)
    catalog.apply_models([spec(gpu_memory_utilisation=0.85, extra_args=["--enforce-eager"])], actor=None)
    assert Profile.objects.get().gpu_memory_utilisation == 0.85
    reconcile()
    [shard] = desired_shards(node)
    argv = command(shard)
    flag = argv.index("--gpu-memory-utilization")
    assert argv[flag + 1] == "0.85"
    assert argv[-1] == "--enforce-eager"  # the profile's own arguments after it, so that they may override it


def test_unset_vllm_keeps_its_own_and_the_spec_of_a_running_replica_is_as_before() -> None:
    node = make_node(gpus=1)
    catalog.apply_models([spec()], actor=None)
    profile = Profile.objects.get()
    assert profile.gpu_memory_utilisation is None
    reconcile()
    replica = Replica.objects.get()
    # The spec names the fields it always did: a replica placed before the field existed is not replaced.
    assert set(replica.spec) == {"source", "profile", *RUNNING_FIELDS}
    [shard] = desired_shards(node)
    assert "--gpu-memory-utilization" not in command(shard)
    # Set, it changes what the engines run with: the replica is rolled onto it.
    catalog.apply_models([spec(gpu_memory_utilisation=0.5)], actor=None)
    profile.refresh_from_db()
    assert running_spec(profile.model, profile) != replica.spec


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1.5, "Expected a number above 0 and at most 1; got “1.5”."),
        (0, "Expected a number above 0 and at most 1; got “0”."),
        (-0.2, "Expected a number above 0 and at most 1; got “-0.2”."),
        ("most", "Expected a float."),
        (True, "Expected a float."),
    ],
)
def test_a_share_out_of_range_is_refused_with_the_number_and_nothing_is_written(value: Any, message: str) -> None:
    catalog.apply_models([spec(gpu_memory_utilisation=0.9)], actor=None)
    with pytest.raises(catalog.SpecError) as refused:
        catalog.apply_models([spec(gpu_memory_utilisation=value)], actor=None)
    assert refused.value.errors == {FIELD: [message]}
    assert Profile.objects.get().gpu_memory_utilisation == 0.9


def test_an_engine_without_such_a_flag_is_refused_it() -> None:
    with pytest.raises(catalog.SpecError) as refused:
        catalog.apply_models([spec(engine="sglang", gpu_memory_utilisation=0.8)], actor=None)
    assert refused.value.errors == {FIELD: ["sglang takes no GPU memory share; only vllm does."]}


def test_a_change_of_one_profile_is_held_to_the_same_range() -> None:
    catalog.apply_models([spec()], actor=None)
    profile = Profile.objects.select_related("model").get()
    with pytest.raises(ValidationError) as refused:
        catalog.update_profile(profile, actor=None, gpu_memory_utilisation=2.0)
    message = "Expected a number above 0 and at most 1; got “2.0”."
    assert refused.value.message_dict == {"gpu_memory_utilisation": [message]}
    catalog.update_profile(profile, actor=None, gpu_memory_utilisation=0.7)
    assert Profile.objects.get().gpu_memory_utilisation == 0.7


def test_the_api_takes_and_shows_it_and_refuses_it_out_of_range(api: Any) -> None:
    from apps.accounts.choices import StaffRole

    api.force_authenticate(make_user("olga@example.com", role=StaffRole.OPERATOR, name="Olga"))
    applied = api.post("/api/v1/models/apply", {"models": [spec(gpu_memory_utilisation=0.8)]}, format="json")
    assert applied.status_code == 200
    [shown] = api.get("/api/v1/models/big").json()["profiles"]
    assert shown["gpu_memory_utilisation"] == 0.8
    refused = api.post("/api/v1/models/apply", {"models": [spec(gpu_memory_utilisation=1.5)]}, format="json")
    assert refused.status_code == 400
    assert refused.json()["errors"][FIELD] == ["Expected a number above 0 and at most 1; got “1.5”."]


def test_every_declared_field_is_a_column_shown_by_the_api_and_the_admin_and_copied_by_the_simulator() -> None:
    names = profile_fields.field_names()
    assert {"keep_within", "power_watts"} <= set(names)  # facility's, registered by its placement.register()
    assert set(names) <= {f.name for f in Profile._meta.get_fields()}
    assert list(ProfileSerializer().fields) == ["name", *names]
    request = RequestFactory().get("/admin/")
    assert admin.site._registry[Profile].get_fields(request) == ("model", "name", *names)
    assert set(names) <= {f.name for f in dataclasses.fields(SimProfile)}


def test_a_field_an_app_registers_is_read_checked_and_carried_to_placement(monkeypatch: Any) -> None:
    registry = REGISTRY.copy()
    registry.register_profile_field(ProfileField("max_temperature", int, low=30, high=120))
    monkeypatch.setattr(CATALOG, "plugin_fields", registry.profile_fields)
    assert "max_temperature" in profile_fields.spec_keys()
    _values, problems = profile_fields.read_profile({"name": "x", "max_temperature": 200})
    assert problems == {"max_temperature": ["Expected a whole number from 30 to 120; got “200”."]}
    values, problems = profile_fields.read_profile({"name": "x", "max_temperature": 80})
    assert not problems
    row = SimpleNamespace(pk=1, name="x", **values)
    assert profile_spec(row).extra == {"keep_within": "", "power_watts": None, "max_temperature": 80}
