"""What one simulation may ask, and reading a scenario's text within it.

A scenario multiplies work through its `count` fields (nodes in a group, cards in a node type,
models alike), its replicas, steps and events. The parser adds up what is declared as it reads
the document and refuses a scenario past these limits with the numbers, before anything is
built: a 152-byte scenario asking for 10 million GPUs is refused in microseconds.

The console and the API (runs in the worker, `Limits.web()`) are held to the LLMGW_SIM_MAX_*
settings, whose defaults are twice the largest fleet the project simulates itself
(bench/sim.py: 10,000 nodes of 8 GPUs, 2,000 models, a day at one-minute steps). `llmgw sim`
runs on the operator's own machine and takes ten times as much (`Limits.cli()`), and up to
100,000 steps.

The YAML text itself is bounded too: its size before it is read, and after it is read the size
of the document written out whole, every alias expanded where it is used (an alias of an alias
of a list can stand for more values than the text has characters).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import yaml
from django.utils import formats
from django.utils.translation import gettext as _

__all__ = [
    "GPUS_PER_NODE",
    "LOAD_POINTS",
    "MAX_DEPTH",
    "MAX_PROBLEMS",
    "MAX_STEPS",
    "NAME_WIDTH",
    "PROFILES",
    "RAILS",
    "Limits",
    "figure",
    "load_text",
    "written_size",
]

MAX_STEPS = 100_000  # steps a run may take anywhere (the CLI's bound)
GPUS_PER_NODE = 256  # cards one node type may have (the largest machines have 16)
RAILS = 64  # rails of one node's fabric
PROFILES = 32  # profiles of one model
LOAD_POINTS = 1_000  # points of one model's load
NAME_WIDTH = 64  # the widest field of a name pattern such as {n:04d}
MAX_DEPTH = 64  # how deeply the document's mappings and lists may nest
MAX_PROBLEMS = 100  # problems listed one by one; the rest are counted
CLI_SCALE = 10  # how much more `llmgw sim` takes than the console and the API


def figure(number: int) -> str:
    """A whole number with its thousands grouped as the language groups them (10,000,000)."""
    return str(formats.number_format(number, force_grouping=True))


@dataclass(frozen=True)
class Limits:
    """The most one run may ask. `steps` counts the reconciler's passes (a day at one-minute steps
    is 1,441); `replicas` the replicas its models may reach (each model's largest max, counted
    with the `set` events that raise it); `text_bytes` the scenario's text."""

    nodes: int
    gpus: int
    models: int
    replicas: int
    steps: int
    events: int
    text_bytes: int
    node_types: int = 1_000
    groups: int = 1_000
    caps: int = 10_000
    quotas: int = 10_000

    @property
    def written_size(self) -> int:
        """The document written out whole may be twice its text (a few aliases are fine)."""
        return 2 * self.text_bytes

    @classmethod
    def web(cls) -> Limits:
        """What a run from the console or the API may ask (LLMGW_SIM_MAX_* settings)."""
        from django.conf import settings

        return cls(
            nodes=settings.SIM_MAX_NODES,
            gpus=settings.SIM_MAX_GPUS,
            models=settings.SIM_MAX_MODELS,
            replicas=settings.SIM_MAX_REPLICAS,
            steps=settings.SIM_MAX_WEB_STEPS,
            events=settings.SIM_MAX_EVENTS,
            text_bytes=settings.SIM_MAX_SCENARIO_BYTES,
        )

    @classmethod
    def cli(cls) -> Limits:
        """What `llmgw sim` may ask on the operator's own machine: ten times the web's, and up to
        100,000 steps."""
        web = cls.web()
        return replace(
            web,
            nodes=web.nodes * CLI_SCALE,
            gpus=web.gpus * CLI_SCALE,
            models=web.models * CLI_SCALE,
            replicas=web.replicas * CLI_SCALE,
            steps=MAX_STEPS,
            events=web.events * CLI_SCALE,
            text_bytes=web.text_bytes * CLI_SCALE,
        )


def _loader() -> type[Any]:
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_text(text: str, limits: Limits) -> Any:
    """The document a scenario's text holds; ValueError saying why when it is too large or not
    YAML (the parser turns it into a ScenarioError)."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > limits.text_bytes:
        raise ValueError(
            _("the scenario is %(size)s bytes, more than the %(max)s a run here may take")
            % {"size": figure(size), "max": figure(limits.text_bytes)}
        )
    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 - a safe loader (C or Python)
    except yaml.YAMLError as exc:
        raise ValueError(_("not valid YAML: %(why)s") % {"why": str(exc).splitlines()[0]}) from None
    except RecursionError:
        raise ValueError(_("not valid YAML: nested more than %(max)s deep") % {"max": MAX_DEPTH}) from None


def _scalar_size(value: Any) -> int:
    if isinstance(value, str | bytes):
        return len(value) + 1
    return 8


def written_size(document: Any, limit: int) -> str | None:
    """Why the document is too large to take, or None. It is walked as if written out whole,
    every shared (aliased) part counted each time it is used, and the walk stops once `limit`
    characters or MAX_DEPTH levels are passed: linear in the limit, whatever the document."""
    total = 0
    stack: list[tuple[Any, int]] = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return _("the document nests more than %(max)s deep") % {"max": MAX_DEPTH}
        if isinstance(value, dict):
            # Each item is counted before it is put on the stack, so the stack never holds more than the limit.
            total += 2 + len(value) + sum(_scalar_size(key) for key in value)
            items: Any = value.values()
        elif isinstance(value, list | tuple):
            total += 2 + len(value)
            items = value
        else:
            total += _scalar_size(value)
            items = ()
        if total > limit:
            return _(
                "the scenario written out whole (its aliases expanded) is more than the %(max)s characters"
                " a run here may take"
            ) % {"max": figure(limit)}
        stack.extend((item, depth + 1) for item in items)
    return None
