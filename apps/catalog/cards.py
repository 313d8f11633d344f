"""Parts other apps add to a model's card in the console, registered from their AppConfig.ready().

The catalog sits below the apps that serve its models (the gateway, which knows who waits for
them), so it never imports them: each registers a function that, given a model and the person
looking, returns a part to show (a template and what it reads) or None. A part that fails is
left out and logged; the card is shown without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apps.catalog.models import Model

__all__ = ["PARTS", "CardPart", "parts_for", "register"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CardPart:
    """A section of a model's card: a template, and what it reads as `part`."""

    template: str
    context: dict[str, Any] = field(default_factory=dict)


PartMaker = Callable[[Model, Any], CardPart | None]

PARTS: list[PartMaker] = []


def register(maker: PartMaker) -> None:
    """Add a part to every model's card (once, however often ready() runs)."""
    if maker not in PARTS:
        PARTS.append(maker)


def parts_for(model: Model, user: Any) -> list[CardPart]:
    """The parts registered apps show on `model`'s card for `user`, in the order they registered."""
    parts = []
    for maker in PARTS:
        try:
            part = maker(model, user)
        except Exception:
            log.exception("the model card's part %s failed for %s", getattr(maker, "__qualname__", maker), model.name)
            continue
        if part is not None:
            parts.append(part)
    return parts
