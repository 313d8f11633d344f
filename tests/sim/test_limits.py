"""What one scenario may ask: refused from the declared counts with the numbers, before anything
is built (a scenario that built what it asks before counting would not come back from these),
and every name checked once."""

from __future__ import annotations

from typing import Any

import pytest

from apps.sim import run, scenario
from apps.sim.limits import Limits
from bench.sim import scenario as bench_fleet

# 152 bytes asking for 10 million GPUs: 1,250,000 nodes of 8.
TEN_MILLION_GPUS = (
    "node_types: {g: {gpus: {class: H100-80GB, count: 8}}}\n"
    "nodes: [{type: g, count: 1250000}]\n"
    "models: [{name: m, profiles: [{accelerator: H100-80GB, gpus: 8}]}]\n"
)


def problems_of(source: Any, limits: Limits | None = None) -> list[str]:
    with pytest.raises(scenario.ScenarioError) as caught:
        scenario.parse(source, limits=limits or Limits.web())
    return caught.value.problems


def small(**change: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "node_types": {"g": {"gpus": {"class": "L4", "count": 4}}},
        "nodes": [{"type": "g", "count": 2}],
        "models": [{"name": "m", "profiles": [{"accelerator": "L4", "gpus": 1}]}],
    }
    data.update(change)
    return data


def test_ten_million_gpus_are_refused_with_the_numbers_before_a_node_is_built() -> None:
    assert len(TEN_MILLION_GPUS) <= 160
    assert problems_of(TEN_MILLION_GPUS) == [
        "scenario.nodes: 1,250,000 nodes is more than the 20,000 a run here may have",
        "scenario.nodes: 10,000,000 GPUs is more than the 160,000 a run here may have",
    ]
    # `llmgw sim` takes ten times as much, and refuses a fleet no machine could hold the same way.
    huge = TEN_MILLION_GPUS.replace("1250000", "1000000000000")
    assert "scenario.nodes: 1,000,000,000,000 nodes is more than the 200,000 a run here may have" in problems_of(
        huge, Limits.cli()
    )


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            {"node_types": {"g": {"gpus": {"class": "L4", "count": 10**9}}}},
            "node_types.g.gpus.count: 1,000,000,000 GPUs in one node is more than the 256 a node type may have",
        ),
        (
            {"models": [{"name": "m", "count": 10**12, "profiles": [{"accelerator": "L4", "gpus": 1}]}]},
            "scenario.models: 1,000,000,000,000 models is more than the 5,000 a run here may have",
        ),
        (
            {"models": [{"name": "m", "max": 10**9, "profiles": [{"accelerator": "L4", "gpus": 1}]}]},
            "models[0].max: 1,000,000,000 replicas is more than the 20,000 a run here may have",
        ),
        (
            {"events": [{"at": "1m", "set": {"model": "m", "min": 10**12}}]},
            "scenario.models: 1,000,000,000,000 replicas is more than the 20,000 a run here may have",
        ),
        ({"duration": "2d"}, "scenario.duration: 2,881 steps of 0:01:00 is more than the 1,441 a run here may take"),
        ({"duration": "99999999999d"}, "scenario.duration: must be a duration"),
        ({"duration": "4000d"}, "scenario.duration: must be at most 3,650 days"),
        ({"nodes": [{"type": "g", "count": 2, "name": "{n:999999999}"}]}, "nodes[0].name: a field's width is at most"),
        ({"nodes": [{"type": "g", "count": 2, "name": "{n:{type}}"}]}, "nodes[0].name: must be a pattern"),
        ({"nodes": [{"type": "g", "count": 2, "name": "{type.__class__}"}]}, "nodes[0].name: must be a pattern"),
        ({"nodes": [{"type": "g", "count": 2, "fabric": {"name": "ib", "rails": 10**6}}]}, "nodes[0].fabric.rails"),
        ({"events": [{"at": "1m", "load": {"model": "m", "factor": "lots"}}]}, "events[0].load.factor: must be"),
        ({"events": [{"at": "1m", "lose": {"count": "all"}}]}, "events[0].lose.count: must be a whole number"),
        ({"events": [{"at": "1m", "lose": {"nodes": 5}}]}, "events[0].lose.nodes: must be a node's name"),
    ],
)
def test_what_a_run_may_ask_is_held_to_its_limits(change: dict[str, Any], problem: str) -> None:
    found = problems_of(small(**change))
    assert any(p.startswith(problem) for p in found), found


def test_more_events_or_a_longer_text_than_allowed_are_refused_with_the_numbers(settings: Any) -> None:
    settings.SIM_MAX_EVENTS = 3
    events = [{"at": f"{i}m", "lose": {"count": 1}} for i in range(4)]
    assert problems_of(small(events=events)) == ["scenario.events: 4 events is more than the 3 a run here may have"]
    settings.SIM_MAX_SCENARIO_BYTES = 1024
    text = "# " + "x" * 2000 + "\n"
    assert problems_of(text) == [f"the scenario is {len(text):,} bytes, more than the 1,024 a run here may take"]


def test_aliases_that_stand_for_more_than_the_text_are_refused() -> None:
    # Nine levels of ten aliases each: a billion values from a few hundred bytes.
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 9):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    lines.append("nodes: [{type: g, count: 1, labels: {big: *a8}}]")
    (problem,) = problems_of("\n".join(lines))
    assert problem.startswith("the scenario written out whole (its aliases expanded) is more than the 2,097,152")
    (problem,) = problems_of("nodes: &a [*a]\n")  # a list that holds itself
    assert "written out whole" in problem or "nests more than" in problem


def test_problems_past_a_hundred_are_counted_not_listed() -> None:
    found = problems_of(small(**{f"key{i}": 1 for i in range(500)}))
    assert len(found) == 101 and found[-1] == "and 400 more problems"


def test_the_benchs_fleet_is_within_the_web_limits_and_ten_times_it_within_the_clis() -> None:
    scenario.parse(bench_fleet(nodes=10_000, models=2_000, hours=24), limits=Limits.web())
    scenario.parse(bench_fleet(nodes=100_000, models=20_000, hours=24 * 30), limits=Limits.cli())
    assert problems_of(bench_fleet(nodes=100_000, models=2_000, hours=24)) == [
        "scenario.nodes: 100,000 nodes is more than the 20,000 a run here may have",
        "scenario.nodes: 800,000 GPUs is more than the 160,000 a run here may have",
    ]


def test_a_name_described_twice_is_found_once_among_thousands() -> None:
    # Models m-0000 .. m-3999, and one more named as the 1,234th: that one is the only problem.
    profiles = [{"accelerator": "L4", "gpus": 1}]
    found = problems_of(
        small(
            models=[
                {"name": "m", "count": 4000, "min": 0, "max": 1, "profiles": profiles},
                {"name": "m-1234", "profiles": profiles},
            ]
        )
    )
    assert found == ["scenario.models: model m-1234 is described twice"]


def test_names_the_fleet_lacks_are_each_said_and_only_the_first_get_a_hint() -> None:
    data = small(
        nodes=[{"type": "g", "count": 3000, "rack": {"size": 4}}],
        events=[{"at": "1m", "lose": {"nodes": [f"g-{i:04d}x" for i in range(200)]}}],
    )
    parsed = scenario.parse(data, limits=Limits.web())
    with pytest.raises(scenario.ScenarioError) as caught:
        run.Simulation(parsed)
    found = caught.value.problems
    assert len(found) == 101 and found[-1] == "and 100 more problems"
    assert found[0].startswith("events[0].lose.nodes: no node g-0000x in the fleet (did you mean g-")
    assert found[50] == "events[0].lose.nodes: no node g-0050x in the fleet"


def test_a_node_lost_twice_in_one_event_is_lost_once() -> None:
    data = small(
        nodes=[{"type": "g", "count": 6, "rack": {"size": 3}}],
        events=[{"at": "1m", "lose": {"nodes": ["g-0001", "g-0002"], "rack": "r01", "count": 2}}],
        duration="2m",
    )
    report = run.simulate(scenario.parse(data))
    # r01 holds g-0001..g-0003; the count adds the next two ready nodes: five in all.
    assert report["snapshots"][1]["event"].startswith("lose") and report["snapshots"][1]["nodes_ready"] == 1
