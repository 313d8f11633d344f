"""A model whose profile states no context: the gateway takes the context from what its engine
said of itself once ready (the agent reads `/v1/models`; apps/gateway/tables.py), so a prompt that
cannot fit is refused before any engine sees it. What the engine says is read the same way for
llama.cpp (its slot's n_ctx), vLLM and SGLang (max_model_len)."""

from __future__ import annotations

import json

import pytest

from agent.engine_metrics import context_of
from apps.cluster.models import Shard
from apps.gateway.intake import Refused, check_fits
from apps.gateway.tables import load_tables
from tests.builders import make_model, make_node, make_replica


@pytest.mark.django_db
def test_the_routes_context_is_the_profiles_else_the_engines() -> None:
    node = make_node("n1")
    stated = make_model("stated", cores=1)
    stated.profiles.update(context_size=4096)
    unstated = make_model("unstated", cores=1)
    make_replica(stated, node)
    replica = make_replica(unstated, node)
    assert [u.context_size for u in load_tables().models["unstated"].upstreams] == [None]  # not said yet
    Shard.objects.filter(replica=replica).update(context_tokens=2048)
    tables = load_tables()
    assert [u.context_size for u in tables.models["unstated"].upstreams] == [2048]
    assert [u.context_size for u in tables.models["stated"].upstreams] == [4096]


def test_a_30_mb_prompt_is_refused_by_the_engines_own_context() -> None:
    prompt = {"messages": [{"role": "user", "content": "é" * (15 * 2**20)}]}  # 30 MB of UTF-8
    with pytest.raises(Refused) as refused:
        check_fits(prompt, 2048)
    assert refused.value.status == 400 and "more than the model's context of 2048 tokens" in refused.value.message


@pytest.mark.parametrize(
    ("answer", "tokens"),
    [
        # llama-server (this project's build, -c 512 -np 2)
        ({"object": "list", "data": [{"id": "tiny", "meta": {"n_ctx": 256, "n_ctx_train": 512}}]}, 256),
        # vLLM and SGLang
        ({"object": "list", "data": [{"id": "m", "max_model_len": 32768}]}, 32768),
        ({"data": []}, None),
        ({"data": [{"id": "m", "max_model_len": 2**40}]}, None),
        ({"data": [{"id": "m", "max_model_len": True}]}, None),
        ({"data": [{"id": "m", "max_model_len": "4096"}]}, None),
        ({"data": ["m"]}, None),
        ([], None),
    ],
)
def test_what_an_engine_says_of_its_context_is_read_or_taken_as_unknown(answer: object, tokens: int | None) -> None:
    assert context_of(json.dumps(answer)) == tokens
    assert context_of("not json") is None
