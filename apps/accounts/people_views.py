"""The People page: the organisation tree with a panel per branch, in three tabs.

/people/members/, /people/limits/ and /people/usage/ show the whole tree to staff who read
everything; /org/, /org/limits/ and /org/usage/ show managers the branches they manage (an
administrator there is sent to /people/). `?branch=org:1|team:3|project:7` chooses the branch.
Choosing one in the tree swaps only the panel when htmx asks; without script the link loads
the whole page. Changes post to their own routes, each with its own rule, and answer an htmx
form with the panel again, anything else with a redirect back. Changes to the tree itself
(a new, renamed or removed organisation, team or project) answer an htmx form with the form
again when refused, and with a redirect of the whole page when done, since the tree changed too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django_htmx.http import HttpResponseClientRedirect

from apps.accounts import people_services
from apps.accounts.access import can_change_limits, is_administrator, requires
from apps.accounts.choices import Band, MembershipRole
from apps.accounts.extensions import EXTENSIONS
from apps.accounts.models import ApiKey, Membership, Organization, Project, Team, User
from apps.accounts.people_selectors import (
    EVERYTHING,
    Branch,
    Scope,
    default_branch_key,
    get_branch,
    get_branch_for_user,
    member_rows,
    scope_for,
    tree_rows,
)
from llmgw.http import HtmxHttpRequest, client_address, is_fragment
from llmgw.ids import parse_id

__all__ = [
    "answer",
    "panel_url",
    "org",
    "org_limits",
    "org_usage",
    "people",
    "people_branch_remove",
    "people_branch_rename",
    "people_limits",
    "people_member_add",
    "people_member_remove",
    "people_members",
    "people_organization_add",
    "people_project_add",
    "people_share",
    "people_team_add",
    "people_usage",
    "people_user_reactivate",
    "people_user_suspend",
]

TABS = ("members", "limits", "usage")
TAB_LABELS = {"members": gettext_lazy("Members"), "limits": gettext_lazy("Limits"), "usage": gettext_lazy("Usage")}
# The URL name of each tab, on the staff page and on the managers' page.
AREAS = {
    "people": {"members": "people-members", "limits": "people-limits", "usage": "people-usage"},
    "org": {"members": "org", "limits": "org-limits", "usage": "org-usage"},
}


# Forms -------------------------------------------------------------------------------------


class AddMemberForm(forms.Form):
    """A person, by email address, and the role they get in the branch."""

    email = forms.EmailField(
        label=gettext_lazy("Email address"),
        max_length=254,
        widget=forms.EmailInput(
            attrs={
                "class": "field min-w-0 flex-1",
                "placeholder": gettext_lazy("person@example.com"),
                "autocomplete": "off",
            }
        ),
    )
    role = forms.ChoiceField(
        label=gettext_lazy("Role"),
        choices=MembershipRole.choices,
        initial=MembershipRole.MEMBER,
        widget=forms.Select(attrs={"class": "field w-32"}),
    )

    person: User

    def clean_email(self) -> str:
        email = self.cleaned_data["email"].strip()
        person = User.objects.filter(email__iexact=email).first()
        if person is None:
            raise ValidationError(_("No account has the address %(email)s.") % {"email": email}, code="unknown")
        self.person = person
        return person.email


class NameForm(forms.Form):
    """The name of a new or renamed organisation, team or project.

    Its rules (required, length, no sibling with the same name) are accounts.services', which
    the API applies too; the form only carries the text there.
    """

    name = forms.CharField(
        label=gettext_lazy("Name"),
        required=False,
        widget=forms.TextInput(
            attrs={"class": "field", "id": "branch-name", "maxlength": "200", "autocomplete": "off"}
        ),
    )


class ShareForm(forms.Form):
    """A branch's or a key's weight and, for a project or a key, its highest band.

    The text goes to people_services' parsers, which the API uses too, so both refuse the same
    input with the same words (the field and its range).
    """

    weight = forms.CharField(
        label=gettext_lazy("Weight"),
        max_length=40,
        error_messages={"required": gettext_lazy("Give a weight: a whole number from 1 to 1000.")},
        widget=forms.NumberInput(attrs={"class": "field w-24", "min": "1", "max": "1000", "step": "1"}),
    )
    band = forms.CharField(
        label=gettext_lazy("Highest band"),
        required=False,
        widget=forms.Select(choices=Band.choices, attrs={"class": "field w-36"}),
    )

    @classmethod
    def for_target(cls, target: Organization | Team | Project | ApiKey, **kwargs: Any) -> ShareForm:
        return cls(initial={"weight": target.weight, "band": getattr(target, "band", "")}, **kwargs)

    def clean_weight(self) -> int:
        try:
            return people_services.parse_weight(self.cleaned_data["weight"])
        except ValidationError as error:
            raise ValidationError(error.message_dict["weight"]) from None

    def clean_band(self) -> str | None:
        text = self.cleaned_data.get("band") or ""
        if not text:
            return None
        try:
            return people_services.parse_band(text)
        except ValidationError as error:
            raise ValidationError(error.message_dict["band"]) from None


@dataclass(frozen=True)
class KeyShare:
    """One API key of a project, as its Limits tab shows it, with its form where the person may change it."""

    key: ApiKey
    form: ShareForm | None


# Rendering ---------------------------------------------------------------------------------


def panel_url(area: str, tab: str, branch: Branch | str | None = None, **query: str) -> str:
    key = branch.key if isinstance(branch, Branch) else branch
    params = {"branch": key, **query} if key else query
    return reverse(AREAS[area][tab]) + (f"?{urlencode(params)}" if params else "")


def _panel(request: HtmxHttpRequest, area: str, tab: str, branch: Branch | None, **extra: Any) -> dict[str, Any]:
    """Everything the panel of one branch and tab shows."""
    user: User = request.user  # type: ignore[assignment]
    admin = is_administrator(user)
    context: dict[str, Any] = {
        "area": area,
        "tab": tab,
        "branch": branch,
        "tab_url": reverse(AREAS[area][tab]),
        "tabs": [
            {"label": TAB_LABELS[name], "url": panel_url(area, name, branch), "current": name == tab} for name in TABS
        ],
        # On /org/ every branch shown is one the person manages.
        "can_change_members": admin or area == "org",
        "can_suspend": admin,
        "can_change_limits": area == "people" and can_change_limits(user),
        "can_change_branches": area == "people" and admin,
        **extra,
    }
    if branch is None:
        return context
    if context["can_change_branches"]:
        context.setdefault("rename_form", NameForm(initial={"name": branch.name}))
    if tab == "members":
        context["members"] = member_rows(branch)
        if context["can_change_members"]:
            context.setdefault("add_form", AddMemberForm())
    elif tab == "limits":
        # The rate limit and capacity quota (the quotas app), then its share of a busy model.
        EXTENSIONS.fill_tab(tab, request, branch, context)
        _share_context(user, branch, context)
    else:
        EXTENSIONS.fill_tab(tab, request, branch, context)  # the usage (the quotas app)
    return context


def _share_context(user: User, branch: Branch, context: dict[str, Any]) -> None:
    """The branch's weight (and a project's band and its keys' weights and bands), with a form for
    each the person may change. A form refused before (with its errors) is kept as it was."""
    if not people_services.share_refusal(user, branch.obj):
        context.setdefault("share_form", ShareForm.for_target(branch.obj, prefix="branch"))
    if branch.kind != "project":
        return
    failed: tuple[int, ShareForm] | None = context.get("failed_key_share")
    keys = ApiKey.objects.active().filter(project_id=branch.obj.pk, is_session_key=False).select_related("user")
    rows = []
    manages: bool | None = None  # the same for every key of the project: asked once
    for key in keys.order_by("name", "pk"):
        key.project = branch.obj  # type: ignore[assignment]
        if manages is None:
            manages = people_services.manages_share(user, key)
        form = None
        if manages:
            form = failed[1] if failed and failed[0] == key.pk else ShareForm.for_target(key, prefix=f"key{key.pk}")
        rows.append(KeyShare(key, form))
    context["key_shares"] = rows


def _render(
    request: HtmxHttpRequest,
    area: str,
    tab: str,
    scope: Scope,
    branch: Branch | None,
    rows: list[Any] | None = None,
    **extra: Any,
) -> HttpResponse:
    context = _panel(request, area, tab, branch, **extra)
    if is_fragment(request):
        return render(request, "accounts/people.html#panel", context)
    admin_here = area == "people" and is_administrator(request.user)
    context["tree"] = rows if rows is not None else tree_rows(scope, can_add=admin_here)
    context["can_add_branches"] = admin_here
    context["page_title"] = _("People") if area == "people" else _("My teams")
    return render(request, "accounts/people.html", context)


def _page(request: HtmxHttpRequest, area: str, tab: str) -> HttpResponse:
    scope = EVERYTHING if area == "people" else scope_for(request.user)  # type: ignore[arg-type]
    key = request.GET.get("branch")
    rows = None
    if key:
        branch: Branch | None = get_branch_for_user(scope, key)
    else:  # the first branch of the tree
        rows = tree_rows(scope, can_add=area == "people" and is_administrator(request.user))
        first = default_branch_key(rows)
        branch = get_branch(first) if first else None
    return _render(request, area, tab, scope, branch, rows)


# Pages -------------------------------------------------------------------------------------


@requires("read_everything", methods=["GET"])
def people(request: HttpRequest) -> HttpResponse:
    return HttpResponseRedirect(reverse("people-members") + (f"?{request.GET.urlencode()}" if request.GET else ""))


@requires("read_everything", methods=["GET"])
def people_members(request: HtmxHttpRequest) -> HttpResponse:
    """A branch's members; administrators add, remove and suspend them here."""
    return _page(request, "people", "members")


@requires("read_everything", methods=["GET"])
def people_limits(request: HtmxHttpRequest) -> HttpResponse:
    """A branch's rate limit and capacity quota; administrators and billing edit them in place."""
    return _page(request, "people", "limits")


@requires("read_everything", methods=["GET"])
def people_usage(request: HtmxHttpRequest) -> HttpResponse:
    """A branch's use over the last hour, day, week or month, by child branch and by model."""
    return _page(request, "people", "usage")


def _org_page(request: HtmxHttpRequest, tab: str) -> HttpResponse:
    if is_administrator(request.user):  # everything is on the People page, where it can be changed
        query = f"?{request.GET.urlencode()}" if request.GET else ""
        return HttpResponseRedirect(reverse(AREAS["people"][tab]) + query)
    return _page(request, "org", tab)


@requires("manages_branch", methods=["GET"])
def org(request: HtmxHttpRequest) -> HttpResponse:
    """The members of the branches a manager manages."""
    return _org_page(request, "members")


@requires("manages_branch", methods=["GET"])
def org_limits(request: HtmxHttpRequest) -> HttpResponse:
    return _org_page(request, "limits")


@requires("manages_branch", methods=["GET"])
def org_usage(request: HtmxHttpRequest) -> HttpResponse:
    return _org_page(request, "usage")


# Changes -----------------------------------------------------------------------------------


def _area_of(user: Any) -> str:
    return "people" if is_administrator(user) else "org"


def _change_scope(user: Any) -> Scope:
    """Administrators change any branch's members; a manager those of what they manage."""
    return EVERYTHING if is_administrator(user) else scope_for(user)


def answer(
    request: HtmxHttpRequest,
    area: str,
    tab: str,
    branch: Branch,
    *,
    done: str = "",
    error: str = "",
    invalid: bool = False,
    forms: dict[str, Any] | None = None,
) -> HttpResponse:
    """The panel again for htmx; otherwise the page with the form's errors, or a redirect back."""
    if is_fragment(request) or invalid:
        scope = EVERYTHING if area == "people" else scope_for(request.user)  # type: ignore[arg-type]
        return _render(request, area, tab, scope, branch, panel_done=done, panel_error=error, **(forms or {}))
    if done:
        messages.success(request, done)
    if error:
        messages.error(request, error)
    return HttpResponseRedirect(panel_url(area, tab, branch))


def _membership_branch(membership: Membership) -> Branch:
    if membership.project is not None:
        return Branch("project", membership.project)
    if membership.team is not None:
        return Branch("team", membership.team)
    return Branch("org", membership.organization)


@requires("manages_branch", methods=["POST"])
def people_member_add(request: HtmxHttpRequest) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    branch = get_branch_for_user(_change_scope(user), request.POST.get("branch"))
    form = AddMemberForm(request.POST)
    if form.is_valid():
        try:
            people_services.add_member(
                branch.obj, form.person, form.cleaned_data["role"], actor=user, address=client_address(request)
            )
        except ValidationError as error:
            form.add_error("email", error)
        else:
            done = _("%(email)s added to %(branch)s.") % {"email": form.person.email, "branch": branch.path}
            return answer(request, _area_of(user), "members", branch, done=done)
    return answer(request, _area_of(user), "members", branch, invalid=True, forms={"add_form": form})


@requires("manages_branch", methods=["POST"])
def people_member_remove(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    membership = (
        Membership.objects.select_related("user", "organization", "team__organization", "project__team__organization")
        .filter(pk=pk)
        .first()
    )
    if membership is None:
        raise Http404(_("No such membership."))
    branch = _membership_branch(membership)
    if not _change_scope(user).covers(branch):
        raise Http404(_("No such membership."))
    people_services.remove_member(membership, actor=user, address=client_address(request))
    done = _("%(email)s removed from %(branch)s.") % {"email": membership.user.email, "branch": branch.path}
    return answer(request, _area_of(user), "members", branch, done=done)


def _suspension(request: HtmxHttpRequest, pk: int, *, suspend: bool) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    person = get_object_or_404(User, pk=pk)
    branch = get_branch(request.POST.get("branch"))
    done = error = ""
    try:
        if suspend:
            people_services.suspend_user(person, actor=user, address=client_address(request))
            done = _("%(email)s is suspended.") % {"email": person.email}
        else:
            people_services.reactivate_user(person, actor=user, address=client_address(request))
            done = _("%(email)s may sign in again.") % {"email": person.email}
    except ValidationError as refusal:
        error = " ".join(refusal.messages)
    if branch is not None:
        return answer(request, "people", "members", branch, done=done, error=error)
    if done:
        messages.success(request, done)
    if error:
        messages.error(request, error)
    return HttpResponseRedirect(reverse("people-members"))


@requires("administrator", methods=["POST"])
def people_user_suspend(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """Stop a person signing in (never the last active administrator)."""
    return _suspension(request, pk, suspend=True)


@requires("administrator", methods=["POST"])
def people_user_reactivate(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    return _suspension(request, pk, suspend=False)


# The tree itself: new, renamed and removed organisations, teams and projects -----------------

# The tree's folded "+" form that adds a branch under a parent of each kind (None: the top).
ADD_FORMS = {None: "add-org", "org": "add-team", "team": "add-project"}


def _go(request: HtmxHttpRequest, url: str) -> HttpResponse:
    """After a change to the tree: the whole page again, as htmx would otherwise swap only a part."""
    if is_fragment(request):
        return HttpResponseClientRedirect(url)
    return HttpResponseRedirect(url)


def _tab(request: HttpRequest) -> str:
    tab = request.POST.get("tab", "")
    return tab if tab in TABS else "members"


def _parent_branch(branch: Branch) -> Branch | None:
    obj = branch.obj
    if isinstance(obj, Project):
        return Branch("team", obj.team)
    if isinstance(obj, Team):
        return Branch("org", obj.organization)
    return None


def _new_branch(request: HtmxHttpRequest, parent_kind: str | None) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    parent = None
    if parent_kind is not None:
        parent = get_branch_for_user(EVERYTHING, request.POST.get("branch"))
        if parent.kind != parent_kind:
            raise Http404(_("No such organisation, team or project."))
    form = NameForm(request.POST)
    address = client_address(request)
    try:
        if not form.is_valid():
            raise ValidationError([error for errors in form.errors.values() for error in errors])
        name = form.cleaned_data["name"]
        if parent is None:
            created = Branch("org", people_services.create_organization(name=name, actor=user, address=address))
        elif parent_kind == "org":
            created = Branch("team", people_services.create_team(parent.obj, name=name, actor=user, address=address))  # type: ignore[arg-type]
        else:
            created = Branch(
                "project",
                people_services.create_project(parent.obj, name=name, actor=user, address=address),  # type: ignore[arg-type]
            )
    except ValidationError as refusal:
        message = " ".join(refusal.messages)
        if is_fragment(request):  # the folded form again, open, with the name and why it was refused
            return render(
                request,
                "accounts/people.html#add-branch",
                {
                    "add_kind": ADD_FORMS[parent_kind],
                    "add_key": parent.key if parent else "",
                    "add_value": request.POST.get("name", ""),
                    "add_error": message,
                },
            )
        messages.error(request, message)
        return HttpResponseRedirect(panel_url("people", "members", parent))
    messages.success(request, _("%(branch)s created.") % {"branch": created.path})
    return _go(request, panel_url("people", "members", created))


@requires("administrator", methods=["POST"])
def people_organization_add(request: HtmxHttpRequest) -> HttpResponse:
    """A new organisation at the top of the tree."""
    return _new_branch(request, None)


@requires("administrator", methods=["POST"])
def people_team_add(request: HtmxHttpRequest) -> HttpResponse:
    """A new team under the organisation `branch` names."""
    return _new_branch(request, "org")


@requires("administrator", methods=["POST"])
def people_project_add(request: HtmxHttpRequest) -> HttpResponse:
    """A new project under the team `branch` names."""
    return _new_branch(request, "team")


@requires("administrator", methods=["POST"])
def people_branch_rename(request: HtmxHttpRequest) -> HttpResponse:
    """A new name for the organisation, team or project `branch` names: the same row, slug and all."""
    user: User = request.user  # type: ignore[assignment]
    branch = get_branch_for_user(EVERYTHING, request.POST.get("branch"))
    tab = _tab(request)
    form = NameForm(request.POST)
    before = branch.path
    if form.is_valid():
        try:
            people_services.rename_branch(
                branch.obj, name=form.cleaned_data["name"], actor=user, address=client_address(request)
            )
        except ValidationError as refusal:
            form.add_error(None, refusal)
        else:
            if branch.path != before:
                messages.success(request, _("%(old)s renamed to %(new)s.") % {"old": before, "new": branch.path})
            return _go(request, panel_url("people", tab, branch))
    return answer(request, "people", tab, branch, invalid=True, forms={"rename_form": form})


@requires("administrator", methods=["POST"])
def people_branch_remove(request: HtmxHttpRequest) -> HttpResponse:
    """Remove the organisation, team or project `branch` names; refused, with what is left, while
    anything depends on it."""
    user: User = request.user  # type: ignore[assignment]
    branch = get_branch_for_user(EVERYTHING, request.POST.get("branch"))
    tab = _tab(request)
    path, parent = branch.path, _parent_branch(branch)
    try:
        people_services.remove_branch(branch.obj, actor=user, address=client_address(request))
    except ValidationError as refusal:
        return answer(request, "people", tab, branch, error=" ".join(refusal.messages))
    messages.success(request, _("%(branch)s removed.") % {"branch": path})
    return _go(request, panel_url("people", tab, parent))


# Shares of a busy model ----------------------------------------------------------------------


def _share_target(user: User, branch: Branch, raw_key: str | None) -> Organization | Team | Project | ApiKey:
    """The branch itself, or one of a project's active keys (404 for any other)."""
    if not raw_key:
        return branch.obj
    key_id = parse_id(raw_key, ApiKey)
    key = None
    if key_id is not None and branch.kind == "project":
        key = ApiKey.objects.active().filter(pk=key_id, project_id=branch.obj.pk, is_session_key=False).first()
    if key is None:
        raise Http404(_("No such API key in %(branch)s.") % {"branch": branch.path})
    return key


@requires("manages_branch", methods=["POST"])
def people_share(request: HtmxHttpRequest) -> HttpResponse:
    """Set the weight (and a project's or key's band) of the branch `branch` names, or of its key `key`.

    Those who may not change it are refused with 403 saying who may (people_services.share_refusal);
    a branch or key outside what the person manages is a 404.
    """
    user: User = request.user  # type: ignore[assignment]
    branch = get_branch_for_user(_change_scope(user), request.POST.get("branch"))
    target = _share_target(user, branch, request.POST.get("key"))
    refusal = people_services.share_refusal(user, target)
    if refusal:
        raise PermissionDenied(refusal)
    prefix = f"key{target.pk}" if isinstance(target, ApiKey) else "branch"
    form = ShareForm(request.POST, prefix=prefix)
    if form.is_valid():
        try:
            people_services.set_share(
                target,  # type: ignore[type-var]  # one of the four kinds, whichever it is
                weight=form.cleaned_data["weight"],
                band=form.cleaned_data["band"] if isinstance(target, Project | ApiKey) else None,
                actor=user,
                address=client_address(request),
            )
        except ValidationError as error:
            _add_share_errors(form, error)
        except PermissionDenied as error:
            form.add_error(None, str(error))
        else:
            done = (
                _("The share of key %(name)s saved.") % {"name": target.name}
                if isinstance(target, ApiKey)
                else _("The share of %(branch)s saved.") % {"branch": branch.path}
            )
            return answer(request, _area_of(user), "limits", branch, done=done)
    forms = {"failed_key_share": (target.pk, form)} if isinstance(target, ApiKey) else {"share_form": form}
    return answer(request, _area_of(user), "limits", branch, invalid=True, forms=forms)


def _add_share_errors(form: ShareForm, error: ValidationError) -> None:
    if not hasattr(error, "error_dict"):
        form.add_error(None, error.messages)
        return
    for field, messages_ in error.message_dict.items():
        form.add_error(field if field in form.fields else None, messages_)
