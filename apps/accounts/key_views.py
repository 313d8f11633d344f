"""The pages about API keys: one's own keys, the account page that connects an editor, and
the install scripts that page hands out (served without a session, holding no secret)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, pgettext
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from apps.accounts import editors, people_services, services
from apps.accounts.access import public, requires
from apps.accounts.extensions import EXTENSIONS
from apps.accounts.models import ApiKey, User
from apps.accounts.selectors import projects_for_user
from llmgw.http import client_address
from llmgw.ids import parse_id

__all__ = ["ApiKeyForm", "ConnectForm", "account", "api_keys", "connect_script", "server_address"]

EXPIRY_DAYS = {"": None, "7": 7, "30": 30, "90": 90, "365": 365}
EXPIRY_CHOICES = [
    ("", gettext_lazy("Never")),
    ("7", gettext_lazy("In 7 days")),
    ("30", gettext_lazy("In 30 days")),
    ("90", gettext_lazy("In 90 days")),
    ("365", gettext_lazy("In a year")),
]
NO_SUCH_MODEL = gettext_lazy("There is no model named “%(value)s”.")


def server_address(request: HttpRequest) -> str:
    """Where people reach this gateway, without a trailing slash."""
    return (settings.PUBLIC_URL or request.build_absolute_uri("/")).rstrip("/")


def _models() -> Any:
    return EXTENSIONS.models()


# API keys ------------------------------------------------------------------------------


class ApiKeyForm(forms.Form):
    name = forms.CharField(
        label=gettext_lazy("Name"),
        max_length=200,
        error_messages={"required": gettext_lazy("Give the key a name, so you can tell it apart later.")},
    )
    project = forms.ModelChoiceField(
        label=gettext_lazy("Project"),
        queryset=projects_for_user(None),
        required=False,
        empty_label=gettext_lazy("No project"),
        error_messages={"invalid_choice": gettext_lazy("You are not a member of this project.")},
    )
    expires = forms.ChoiceField(label=gettext_lazy("Expires"), choices=EXPIRY_CHOICES, required=False, initial="30")
    allowed_models: forms.ModelMultipleChoiceField[Any] = forms.ModelMultipleChoiceField(
        label=gettext_lazy("Allowed models"),
        queryset=None,  # the live models (_models), set for each form
        to_field_name="name",
        required=False,
        help_text=gettext_lazy("Choose none to allow every model."),
        error_messages={"invalid_choice": NO_SUCH_MODEL},
    )

    def __init__(self, *args: Any, user: User, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = projects_for_user(user)  # type: ignore[attr-defined]
        self.fields["allowed_models"].queryset = _models()  # type: ignore[attr-defined]

    def expires_at(self) -> datetime | None:
        days = EXPIRY_DAYS[self.cleaned_data.get("expires") or ""]
        return timezone.now() + timedelta(days=days) if days else None


@never_cache  # the page that shows a new key must not linger in a cache
@requires("signed_in", methods=["GET", "POST"])
def api_keys(request: HttpRequest) -> HttpResponse:
    """Create, list and revoke one's own API keys. A new key is shown once."""
    user: User = request.user  # type: ignore[assignment]
    new_secret = None
    form = ApiKeyForm(user=user)
    if request.method == "POST":
        if "revoke" in request.POST:
            pk = parse_id(request.POST.get("revoke"), ApiKey)
            if pk is None:
                raise Http404
            key = get_object_or_404(ApiKey, pk=pk, user=user, is_session_key=False)
            services.revoke_api_key(key, actor=user, address=client_address(request))
            messages.success(request, _("Key “%(name)s” revoked.") % {"name": key.name})
            return HttpResponseRedirect(reverse("api-keys"))
        if "band_key" in request.POST:
            return _lower_band(request, user)
        form = ApiKeyForm(request.POST, user=user)
        if form.is_valid():
            new = services.create_api_key(
                user,
                name=form.cleaned_data["name"],
                project=form.cleaned_data["project"],
                expires_at=form.expires_at(),
                allowed_models=[m.name for m in form.cleaned_data["allowed_models"]],
                actor=user,
                address=client_address(request),
            )
            new_secret = new.secret
            form = ApiKeyForm(user=user)
    keys = ApiKey.objects.filter(user=user, is_session_key=False).select_related("project__team__organization")
    return render(
        request,
        "accounts/api_keys.html",
        {
            "form": form,
            "keys": keys,
            "new_secret": new_secret,
            "now": timezone.now(),
        },
    )


def _lower_band(request: HttpRequest, user: User) -> HttpResponse:
    """The owner moves one of their keys to a lower band (people_services.set_share says whether)."""
    pk = parse_id(request.POST.get("band_key"), ApiKey)
    if pk is None:
        raise Http404
    key = get_object_or_404(ApiKey, pk=pk, user=user, is_session_key=False)
    try:
        key = people_services.set_share(
            key, band=request.POST.get("band", ""), actor=user, address=client_address(request)
        )
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    except PermissionDenied as error:
        messages.error(request, str(error))
    else:
        messages.success(
            request,
            _("Key “%(name)s” now asks for the %(band)s band at most.")
            % {"name": key.name, "band": key.get_band_display()},
        )
    return HttpResponseRedirect(reverse("api-keys"))


# Editors -------------------------------------------------------------------------------


class ConnectForm(forms.Form):
    tool = forms.ChoiceField(choices=[(tool.slug, tool.label) for tool in editors.TOOLS.values()])
    model: forms.ModelChoiceField[Any] = forms.ModelChoiceField(
        label=gettext_lazy("Model"),
        queryset=None,  # the live models (_models), set for each form
        to_field_name="name",
        error_messages={"invalid_choice": NO_SUCH_MODEL, "required": gettext_lazy("Choose a model.")},
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["model"].queryset = _models()  # type: ignore[attr-defined]


def _connection(tool: editors.Tool, server: str, model: str, new: services.NewKey) -> dict[str, Any]:
    """Everything the page shows once for a new editor key."""
    secret = new.secret
    shown: dict[str, Any] = {
        "tool": tool.slug,
        "label": tool.label,
        "model": model,
        "server": server,
        "api_base": editors.api_base(server),
        "secret": secret,
        "key_name": new.key.name,
        "env_var": editors.ENV_VAR,
    }
    if tool.slug in editors.SCRIPT_TOOLS:
        shown["command"] = editors.install_command(server, tool.slug, model, secret)
    if tool.slug == "continue":
        shown.update(
            file=editors.CONTINUE_FILE,
            yaml=editors.continue_yaml(server, model),
            env_file=editors.CONTINUE_ENV_FILE,
            env_line=editors.continue_env_line(secret),
        )
    elif tool.slug == "codex":
        shown.update(
            config_file=editors.CODEX_CONFIG_FILE,
            provider_toml=editors.codex_provider_toml(server),
            profile_file=editors.CODEX_PROFILE_FILE,
            profile_toml=editors.codex_profile_toml(model),
            export=f"export {editors.ENV_VAR}={secret}",
            run=f"codex --profile {editors.PROVIDER_ID}",
        )
    else:
        # Cline's own names for its settings, which the person looks for on its settings page.
        shown["fields"] = [
            (pgettext("Cline setting", "API Provider"), "OpenAI Compatible"),
            (pgettext("Cline setting", "Base URL"), editors.api_base(server)),
            (pgettext("Cline setting", "API Key"), secret),
            (pgettext("Cline setting", "Model ID"), model),
        ]
    return shown


@never_cache  # the page that shows a new key must not linger in a cache
@requires("signed_in", methods=["GET", "POST"])
def account(request: HttpRequest) -> HttpResponse:
    """The person's account: their keys at a glance, the guardrail policies their requests meet, and
    a key and settings for each editor."""
    user: User = request.user  # type: ignore[assignment]
    server = server_address(request)
    model_names = list(_models().values_list("name", flat=True))
    connection = None
    form = ConnectForm()
    chosen = model_names[0] if model_names else ""
    if request.method == "POST":
        form = ConnectForm(request.POST)
        if form.is_valid():
            tool = editors.TOOLS[form.cleaned_data["tool"]]
            chosen = form.cleaned_data["model"].name
            name = f"{tool.label} ({timezone.localdate().isoformat()})"
            new = services.create_api_key(user, name=name, actor=user, address=client_address(request))
            connection = _connection(tool, server, chosen, new)
            form = ConnectForm()
    tools = [
        {
            "slug": tool.slug,
            "label": tool.label,
            "errors": form.errors if form.is_bound and form.data.get("tool") == tool.slug else None,
            "connection": connection if connection and connection["tool"] == tool.slug else None,
        }
        for tool in editors.TOOLS.values()
    ]
    active_keys = ApiKey.objects.active().filter(user=user, is_session_key=False).count()
    return render(
        request,
        "accounts/account.html",
        {
            "tools": tools,
            "model_names": model_names,
            "chosen": chosen,
            "server": server,
            "api_base": editors.api_base(server),
            "active_keys": active_keys,
            **EXTENSIONS.account_page(user),  # the guardrail policies in force (the guardrails app)
        },
    )


@public  # `curl … | sh` has no session; the script holds no secret
@require_GET
def connect_script(request: HttpRequest, tool: str) -> HttpResponse:
    """The install script for Continue or Codex, with this gateway's address and a model in it.

    Public, so that `curl … | sh` works without a session: it holds no secret, and takes the
    key from LLMGW_API_KEY. ?model=NAME picks an existing model; without it, the first.
    """
    if tool not in editors.SCRIPT_TOOLS:
        raise Http404
    name = request.GET.get("model", "")
    model = _models().filter(name=name).first() if name else _models().first()
    if model is None:
        raise Http404
    try:
        text = editors.script(tool, server_address(request), model.name, settings.API_KEY_PREFIX)
    except ValueError:
        raise Http404 from None
    response = HttpResponse(text, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'inline; filename="{tool}.sh"'
    return response
