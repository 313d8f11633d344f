"""What other apps add to the accounts app, in one place.

The accounts app is the lowest of the core apps (accounts < quotas < catalog < cluster): it
imports none of them, not even inside a function (an import-linter contract in pyproject.toml
holds it to that). What it needs from them they register here from their AppConfig.ready(), as
the apps above the cluster do in apps.cluster.extensions:

- what hangs from an organisation, team or project and stops its removal, counted and named
  (`add_branch_dependent`: the catalogue's models);
- what goes with a branch when it is removed (`add_branch_removal`: its rate limit and capacity
  quota);
- the People page's tabs another app keeps, each filling its part of the panel's context
  (`add_branch_tab`: the limits and the usage, kept by the quotas app);
- the models people may choose for a key or an editor (`live_models`: the catalogue's);
- parts of a person's account page, each under the name its template reads (`add_account_panel`:
  the guardrail policies their requests meet).

A slot nobody filled answers as "unknown" or "nothing" (no count, nothing removed, a tab with
only the accounts' own part), never as zero, so the accounts app runs on its own in tests that
leave an app out. `models()` is the exception: a form that offers models needs the catalogue.

    from apps.accounts.extensions import EXTENSIONS

    EXTENSIONS.add_branch_dependent("models", selectors.count_models, selectors.models_phrase)
    EXTENSIONS.live_models = selectors.live_models                     # in CatalogConfig.ready()

Registering is idempotent: ready() may run more than once in a test process. Register module-level
functions, not lambdas, so that a second ready() finds the same function already there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from apps.accounts.models import Organization, Project, Team, User
    from apps.accounts.people_selectors import Branch
    from llmgw.http import HtmxHttpRequest

__all__ = [
    "EXTENSIONS",
    "AccountPanel",
    "BranchCount",
    "BranchDependent",
    "BranchPhrase",
    "BranchRemoval",
    "BranchTab",
    "Extensions",
    "LiveModels",
]

# How many of an app's rows hang from an organisation, team or project (counting those of the
# branches below it), given the branch's row.
BranchCount = Callable[["Organization | Team | Project"], int]
# The words for a count of them in a refusal ("%(count)d models", translated), given the count.
BranchPhrase = Callable[[int], str]
# What an app removes with a branch, before the branch itself goes: its rows that describe only the
# branch, each audited (the row, who removes it, from where).
BranchRemoval = Callable[["Organization | Team | Project", "User | None", "str | None"], None]
# Fills the People page panel's context for a tab the app keeps (the request, the branch shown,
# the context so far: what the accounts app put there, and a form refused before, kept as it was).
BranchTab = Callable[["HtmxHttpRequest", "Branch", dict[str, Any]], None]
# A part of a person's account page: what its template reads under the part's name (falsy: nothing).
AccountPanel = Callable[["User"], Any]
# The models that serve requests, by name: those a key may be limited to or an editor pointed at.
LiveModels = Callable[[], "QuerySet[Any]"]


@dataclass(frozen=True)
class BranchDependent:
    count: BranchCount
    phrase: BranchPhrase


@dataclass
class Extensions:
    branch_dependents: dict[str, BranchDependent] = field(default_factory=dict)
    branch_removals: list[BranchRemoval] = field(default_factory=list)
    branch_tabs: dict[str, BranchTab] = field(default_factory=dict)
    live_models: LiveModels | None = None
    account_panels: dict[str, AccountPanel] = field(default_factory=dict)

    # Registering --------------------------------------------------------------------------------

    def add_branch_dependent(self, name: str, count: BranchCount, phrase: BranchPhrase) -> None:
        self.branch_dependents[name] = BranchDependent(count, phrase)

    def add_branch_removal(self, removal: BranchRemoval) -> None:
        if removal not in self.branch_removals:
            self.branch_removals.append(removal)

    def add_branch_tab(self, tab: str, fill: BranchTab) -> None:
        self.branch_tabs[tab] = fill

    def add_account_panel(self, name: str, panel: AccountPanel) -> None:
        self.account_panels[name] = panel

    # Asking -------------------------------------------------------------------------------------

    def dependents(self, branch: Organization | Team | Project) -> dict[str, int]:
        """Each registered kind of row -> how many hang from the branch (0 included)."""
        return {name: dependent.count(branch) for name, dependent in self.branch_dependents.items()}

    def dependent_phrase(self, name: str, count: int) -> str:
        return self.branch_dependents[name].phrase(count)

    def remove_with(self, branch: Organization | Team | Project, actor: User | None, address: str | None) -> None:
        """What the other apps remove with the branch, before it goes."""
        for removal in self.branch_removals:
            removal(branch, actor, address)

    def fill_tab(self, tab: str, request: HtmxHttpRequest, branch: Branch, context: dict[str, Any]) -> None:
        """The other apps' part of a People page tab; nothing when no app keeps the tab."""
        fill = self.branch_tabs.get(tab)
        if fill is not None:
            fill(request, branch, context)

    def account_page(self, user: User) -> dict[str, Any]:
        """The other apps' parts of a person's account page, by the names its template reads."""
        return {name: panel(user) for name, panel in self.account_panels.items()}

    def models(self) -> QuerySet[Any]:
        """The live models by name; the catalogue registers them (ImproperlyConfigured without it)."""
        if self.live_models is None:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured("no app registered the live models (apps.catalog is not installed)")
        return self.live_models()


EXTENSIONS = Extensions()
