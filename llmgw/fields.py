"""A profile's fields, each declared once (no Django).

A `ProfileField` says everything the rest of llmgw needs to know of one setting of a profile:
its name, type, default, the range or values it may take and what it means. From the
declarations the catalog reads a model spec, checks what the API and the admin store, and picks
the fields it shows; the reconciler builds placement's `ProfileSpec` and the spec its engines run
with; the simulator reads a scenario's profiles. The catalog declares the fields of every
profile (apps.catalog.profile_fields); an app whose placement rule a profile sets declares its
own with `register_profile_field` from its `placement.register()`, beside the rule that reads it
(placement's registry, which the cluster app hands the catalogue: apps.catalog.extensions).

A refusal is a `Reason` (the catalog's wording, with the value that came and the bounds it
missed), translated where it is shown, as placement's own refusals are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.reasons import Reason, gettext_noop, number

__all__ = ["FieldError", "ProfileField"]

# The types a field may hold; a plugin's field holds a scalar, so that its value can key a cache.
KINDS = (int, float, str, bool, dict, list)
SCALARS = (int, float, str, bool)


class FieldError(ValueError):
    """A spec's value for a field that cannot be stored: why, with the numbers."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.message())
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ProfileField:
    """One setting of a profile.

    `name` is the attribute (the catalog's column) and, unless `spec_key` says otherwise, the key a
    model spec gives it by (`aliases` are other keys taken for it). `default` is what a spec that
    leaves it out gets (None: unset, the engine's or placement's own default). A number is held to
    `low`..`high` (`above`: `low` itself is refused, as 0 in 0 < x <= 1); a text to `choices`
    ("" always means unset). `read` replaces the type and range checks for a value that needs
    parsing ("24GB"): it returns the value to store or raises ValueError, and `expected` is then
    what the refusal says (a msgid; it may use %(value)s, %(low)s, %(high)s and %(max)s).

    `placement`: placement's ProfileSpec carries it. `running`: the engines are started with it,
    so a change replaces a model's replicas rather than leaving them on the old value.
    `engine_flags` (engine, flag): the engines it is passed to, on their command line as the flag
    and its value when it is set (before the profile's extra_args, which may override it); no other
    engine takes it. `help` and
    `label` are msgids (gettext_noop here, gettext_lazy in Django code), translated where shown.
    """

    name: str
    kind: type
    default: Any = None
    low: float | None = None
    high: float | None = None
    above: bool = False
    choices: tuple[str, ...] = ()
    label: Any = ""
    help: Any = ""
    placement: bool = False
    running: bool = False
    engine_flags: tuple[tuple[str, str], ...] = ()
    spec_key: str = ""
    aliases: tuple[str, ...] = ()
    read: Callable[[Any], Any] | None = None
    expected: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"profile field {self.name}: a field holds one of {[k.__name__ for k in KINDS]}")

    @property
    def key(self) -> str:
        """The key a model spec names it by."""
        return self.spec_key or self.name

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key, *self.aliases)

    def flag(self, engine: str) -> str | None:
        """The flag an engine takes it by; None when that engine does not take it."""
        return next((flag for name, flag in self.engine_flags if name == engine), None)

    def arguments(self, engine: str, value: Any) -> list[str]:
        """What it adds to the engine's command line: the flag and the value, when set and taken."""
        flag = self.flag(engine)
        return [flag, str(value)] if flag is not None and value is not None else []

    def given(self, spec: dict[str, Any]) -> Any:
        """The spec's value for it (its key first, then its aliases), or its default."""
        for key in self.keys:
            if key in spec:
                return spec[key]
        return self.default

    def parse(self, value: Any) -> Any:
        """The value to store for a spec's `value`; raises FieldError saying why it cannot be."""
        if self.read is not None:
            try:
                return self.read(value)
            except ValueError:
                raise FieldError(self.refusal(value, self.expected)) from None
        if value is None:
            return None
        problem = self.problem(value)
        if problem is not None:
            raise FieldError(problem)
        return float(value) if self.kind is float else value

    def problem(self, value: Any) -> Reason | None:
        """Why a value of it cannot be stored (None when it can, and for None: unset)."""
        if value is None:
            return None
        if self.read is not None:
            try:
                self.read(value)
            except ValueError:
                return self.refusal(value, self.expected)
            return None
        if not self._of_kind(value):
            return self.refusal(value, self.expected or gettext_noop("Expected a %(kind)s."))
        if isinstance(value, int | float) and not self._in_range(value):
            return self.refusal(value, self.expected or self._range_template())
        if self.choices and value and value not in self.choices:
            return self.refusal(value, self.expected or gettext_noop("Expected one of %(levels)s; got “%(value)s”."))
        return None

    def refusal(self, value: Any, template: str) -> Reason:
        params = {
            "kind": self.kind.__name__,
            "value": value,
            "low": _figure(self.low),
            "high": _figure(self.high),
            "max": _figure(self.high),
            "levels": ", ".join(c for c in self.choices if c),
        }
        return Reason(f"profile_{self.name}", template, params)

    def _of_kind(self, value: Any) -> bool:
        if isinstance(value, bool) and self.kind is not bool:
            return False
        if self.kind is float:  # a whole number is a number too (YAML reads 1 as an int)
            return isinstance(value, int | float)
        return isinstance(value, self.kind)

    def _in_range(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.above else value < self.low):
            return False
        if self.high is not None and value > self.high:
            return False
        return not math.isnan(value)  # NaN is no number

    def _range_template(self) -> str:
        if self.kind is int:
            return gettext_noop("Expected a whole number from %(low)s to %(high)s; got “%(value)s”.")
        if self.above:
            return gettext_noop("Expected a number above %(low)s and at most %(high)s; got “%(value)s”.")
        return gettext_noop("Expected a number from %(low)s to %(high)s; got “%(value)s”.")


def _figure(value: float | None) -> str:
    return "-" if value is None else number(value)
