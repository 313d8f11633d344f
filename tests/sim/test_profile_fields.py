"""A scenario's profiles read the fields placement's plugins declare as a model file does."""

from __future__ import annotations

from typing import Any

import pytest

from apps.sim import run, scenario


def fleet(**profile: Any) -> dict[str, Any]:
    return {
        "node_types": {"h100": {"gpus": {"class": "H100-80GB", "count": 8}}},
        "nodes": [{"type": "h100", "count": 2}],
        "models": [{"name": "big", "profiles": [{"accelerator": "H100-80GB", "gpus": 8, "nodes": 2, **profile}]}],
    }


def test_keep_within_and_power_are_read_as_a_model_file_reads_them() -> None:
    found = scenario.parse(fleet(keep_within="rack", power_watts=5600))
    [profile] = found.models[0].profiles
    assert profile.extra == {"keep_within": "rack", "power_watts": 5600}
    [model] = run._models(found, 1, 1)
    assert model.profiles[0].keep_within == "rack" and model.profiles[0].power_watts == 5600
    [model] = run._models(scenario.parse(fleet()), 1, 1)
    assert model.profiles[0].keep_within == "" and model.profiles[0].power_watts is None


def test_a_wrong_value_is_refused_with_where_and_why() -> None:
    with pytest.raises(scenario.ScenarioError) as refused:
        scenario.parse(fleet(keep_within="rak", power_watts=0))
    assert refused.value.problems == [
        "models[0].profiles[0].keep_within: Expected one of site, room, row, rack, pdu; got “rak”.",
        "models[0].profiles[0].power_watts: Expected a whole number from 1 to 1000000; got “0”.",
    ]
