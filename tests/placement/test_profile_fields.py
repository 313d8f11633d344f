"""A profile field's declaration (placement.ProfileField): what it takes, what it refuses and why,
and how a plugin registers one."""

from __future__ import annotations

from typing import Any

import pytest

from apps.cluster.placement import FieldError, ProfileField, ProfileSpec, Registry

SHARE = ProfileField("share", float, low=0, high=1, above=True)
LEVEL = ProfileField("level", str, default="", choices=("rack", "pdu"))
COUNT = ProfileField("count", int, default=1, low=1, high=8)


def refusal(declared: ProfileField, value: Any) -> str:
    with pytest.raises(FieldError) as refused:
        declared.parse(value)
    return refused.value.reason.message()


def test_a_value_in_range_is_taken_and_a_whole_number_is_a_number_too() -> None:
    assert SHARE.parse(0.5) == 0.5
    assert SHARE.parse(1) == 1.0 and isinstance(SHARE.parse(1), float)
    assert SHARE.parse(None) is None  # unset
    assert LEVEL.parse("rack") == "rack" and LEVEL.parse("") == ""
    assert COUNT.parse(8) == 8


def test_a_value_out_of_range_is_refused_with_the_bounds_and_the_value() -> None:
    assert refusal(SHARE, 0) == "Expected a number above 0 and at most 1; got “0”."
    assert refusal(SHARE, 1.01) == "Expected a number above 0 and at most 1; got “1.01”."
    assert refusal(SHARE, float("nan")).startswith("Expected a number above 0")
    assert refusal(COUNT, 9) == "Expected a whole number from 1 to 8; got “9”."
    assert refusal(LEVEL, "rak") == "Expected one of rack, pdu; got “rak”."


def test_a_value_of_another_type_is_refused_and_a_boolean_is_no_number() -> None:
    assert refusal(SHARE, "most") == "Expected a float."
    assert refusal(COUNT, True) == "Expected a int."
    assert refusal(COUNT, 2.0) == "Expected a int."


def test_a_field_that_parses_says_what_it_expected() -> None:
    def size(value: Any) -> int:
        if not isinstance(value, str) or not value.endswith("GB"):
            raise ValueError
        return int(value[:-2])

    declared = ProfileField("size", int, read=size, expected="Expected a size such as 24GB; got “%(value)s”.")
    assert declared.parse("24GB") == 24
    assert refusal(declared, "big") == "Expected a size such as 24GB; got “big”."


def test_a_spec_gives_it_by_its_key_or_an_alias_and_otherwise_its_default() -> None:
    memory = ProfileField("memory_bytes", int, default=0, spec_key="memory", aliases=("memory_gb",))
    assert memory.given({"memory": 3}) == 3 and memory.given({"memory_gb": 2}) == 2 and memory.given({}) == 0
    assert memory.keys == ("memory", "memory_gb")


def test_an_engine_flag_is_passed_only_when_set_and_only_to_its_engine() -> None:
    share = ProfileField("share", float, engine_flags=(("vllm", "--share"),))
    assert share.arguments("vllm", 0.5) == ["--share", "0.5"]
    assert share.arguments("vllm", None) == []
    assert share.arguments("sglang", 0.5) == [] and share.flag("sglang") is None


def test_a_plugin_registers_a_scalar_field_read_from_the_profile_with_its_default() -> None:
    registry = Registry()
    registry.register_profile_field(LEVEL)
    with pytest.raises(ValueError, match="scalar"):
        registry.register_profile_field(ProfileField("labels", dict, default={}))
    assert registry.copy().profile_fields() == (LEVEL,)
    profile = ProfileSpec(id=1, name="p", priority=0, engine="vllm", accelerator="cpu")
    assert registry.profile_field(profile, "level") == ""
    profile.extra["level"] = "rack"
    assert registry.profile_field(profile, "level") == "rack"
