"""What the translators read beyond the chat schema: llama.cpp's `timings` and the matched stop."""

from __future__ import annotations

from typing import Any

import pytest

from apps.gateway.translate._common import matched_stop, usage_from_timings, whole_usage, with_timings
from apps.gateway.translate.usage import Usage


def test_timings_give_the_prompt_as_cached_plus_evaluated_and_the_output_as_predicted() -> None:
    chunk = {"choices": [], "timings": {"cache_n": 236, "prompt_n": 12, "prompt_ms": 8.1, "predicted_n": 40}}
    assert usage_from_timings(chunk) == (248, 40)


def test_timings_without_cache_n_count_the_evaluated_prompt() -> None:
    assert usage_from_timings({"timings": {"prompt_n": 24, "predicted_n": 4}}) == (24, 4)


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        ({}, (None, None)),
        ({"timings": None}, (None, None)),
        ({"timings": "fast"}, (None, None)),
        ("not a chunk", (None, None)),
        ({"timings": {"cache_n": 5, "predicted_n": 2}}, (None, 2)),  # no prompt_n: the prompt is unknown
        ({"timings": {"prompt_n": -1, "predicted_n": True}}, (None, None)),  # not counts
        ({"timings": {"prompt_n": 3.0, "predicted_n": 1}}, (None, 1)),
    ],
)
def test_timings_that_say_nothing_are_none(chunk: Any, expected: tuple[int | None, int | None]) -> None:
    assert usage_from_timings(chunk) == expected


def test_usage_wins_over_timings_and_timings_fill_what_it_left_out() -> None:
    reported = Usage(input_tokens=30, output_tokens=None, cached_input_tokens=20)
    merged = with_timings(reported, (31, 7))
    assert merged == Usage(input_tokens=30, output_tokens=7, cached_input_tokens=20)
    assert reported.output_tokens is None  # a new object: the reported one is left as it was
    assert with_timings(None, (None, None)) is None
    assert with_timings(None, (12, 3)) == Usage(input_tokens=12, output_tokens=3)


def test_a_whole_response_without_usage_takes_its_timings() -> None:
    resp = {"choices": [], "timings": {"cache_n": 0, "prompt_n": 9, "predicted_n": 2}}
    assert whole_usage(resp) == Usage(input_tokens=9, output_tokens=2)
    resp["usage"] = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    assert whole_usage(resp) == Usage(input_tokens=9, output_tokens=2)
    assert whole_usage({"choices": []}) is None


@pytest.mark.parametrize(
    ("body", "choice", "expected"),
    [
        ({}, {"stop_reason": "</answer>"}, "</answer>"),  # vLLM, SGLang
        ({}, {"stop_reason": 151645}, None),  # a stop token id
        ({}, {"stop_reason": ""}, None),
        ({}, {"stop_reason": None}, None),
        ({"__verbose": {"stop_type": "word", "stopping_word": "bbb"}}, {}, "bbb"),  # llama-server
        ({"__verbose": {"stop_type": "word", "stopping_word": ""}}, {}, None),
        ({"__verbose": {"stop_type": "eos", "stopping_word": ""}}, {}, None),
        ({"__verbose": {"stop_type": "limit", "stopping_word": "bbb"}}, {}, None),
        ({"__verbose": "yes"}, None, None),
        ({"__verbose": {"stop_type": "word", "stopping_word": "bbb"}}, {"stop_reason": "###"}, "###"),
    ],
)
def test_the_matched_stop_comes_from_stop_reason_or_llama_servers_verbose(
    body: dict[str, Any], choice: Any, expected: str | None
) -> None:
    assert matched_stop(body, choice) == expected
