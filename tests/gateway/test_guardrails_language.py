"""A guardrail's refusal in the site's language. The gateway serves /v1 outside Django's middleware,
so it activates no language per request: its refusals (a guardrail's, a rate limit's) are written
in LLMGW_LANGUAGE, the site's language."""

from __future__ import annotations

from typing import Any

import pytest

from apps.gateway.tables import Guards
from apps.guardrails.engine import RuleSpec
from tests.gateway.harness import Gateway, openai
from tests.gateway.mock_engine import MockEngine

CARD = "4111 1111 1111 1111"
CARDS_REFUSED = RuleSpec("company", "no cards", "detector", "refuse", detector="card")
ONLY_OTHERS = RuleSpec("company", "only others", "models", "refuse", models=("other",))


async def test_a_refusal_is_written_in_turkish_when_the_site_speaks_turkish(
    gw: Gateway, engine: MockEngine, settings: Any
) -> None:
    settings.LANGUAGE_CODE = "tr"
    gw.app.tables.guards = Guards(everyone=[CARDS_REFUSED])
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"charge {CARD} now"}]
        )
    assert caught.value.code == "guardrail_refused"
    assert (
        "“company” korkuluk politikasının “no cards” kuralınca reddedildi: istemde bir ödeme kartı numarası."
        in caught.value.message
    )
    assert CARD not in caught.value.message
    gw.app.tables.guards = Guards(everyone=[ONLY_OTHERS])
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await gw.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "“m” modeli izin verdiği modeller arasında değil" in denied.value.message
    assert engine.seen == []
