"""What Django's part of llmgw answers before and after any view: input no view can use, and
error answers under /api/, which are JSON whatever went wrong.

- `RefuseNul` (a middleware): a NUL character in the decoded path, a query parameter, a form
  field or a cookie is a 400 naming where it is. No name, id or text llmgw keeps can hold one
  (PostgreSQL refuses it in every string it is sent, a lookup included), so it is refused before
  a view can pass it on. JSON bodies are checked by the API's parser (llmgw.api_input); the
  gateway (/v1) and the agent websocket never pass through here and check their own input.
- `JsonApiErrors` (a middleware): under /api/, an error answer that is not JSON (a 405 of a
  Django view, the CSRF page, anything a view or middleware answered in HTML) becomes JSON with
  DRF's `detail` key and the same status.
- `bad_request`, `permission_denied`, `page_not_found`, `server_error`: Django's handler400,
  403, 404 and 500 (llmgw/urls.py). Under /api/ a JSON body, its `detail` saying why (never a
  traceback); elsewhere Django's own pages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.deprecation import MiddlewareMixin
from django.utils.translation import gettext
from django.views import defaults

__all__ = [
    "API_PREFIX",
    "JsonApiErrors",
    "RefuseNul",
    "bad_request",
    "is_api",
    "page_not_found",
    "permission_denied",
    "refusal",
    "server_error",
]

API_PREFIX = "/api/"
NUL = "\x00"


def is_api(request: HttpRequest) -> bool:
    """Whether the request is the REST API's, whose every answer is JSON."""
    return request.path_info.startswith(API_PREFIX)


def refusal(request: HttpRequest, status: int, detail: str, errors: dict[str, list[str]] | None = None) -> HttpResponse:
    """An error answer: JSON under /api/ ({"detail", "errors"} as every API error), plain text elsewhere."""
    if is_api(request):
        body: dict[str, Any] = {"detail": detail}
        if errors:
            body["errors"] = errors
        return JsonResponse(body, status=status)
    return HttpResponse(detail + "\n", status=status, content_type="text/plain; charset=utf-8")


# NUL characters -------------------------------------------------------------------------------


def _shown(name: str) -> str:
    """A parameter's name as an answer can carry it (its own NUL written as an escape)."""
    return name.encode("unicode_escape").decode("ascii")[:60]


def _first_nul(pairs: Iterable[tuple[str, list[str]]]) -> str | None:
    for name, values in pairs:
        if NUL in name or any(NUL in value for value in values):
            return _shown(name)
    return None


def _nul_problem(request: HttpRequest) -> tuple[str, str | None] | None:
    """(Why, the parameter it names) for the first NUL the request holds outside its body's JSON, or None."""
    if NUL in request.path_info:
        return gettext("The path holds a NUL character (U+0000), which no name or id can contain."), None
    cookies = ((name, [value]) for name, value in request.COOKIES.items())
    checks = (
        (request.GET.lists(), gettext("The query parameter “%(name)s” holds a NUL character (U+0000).")),
        (cookies, gettext("The cookie “%(name)s” holds a NUL character (U+0000).")),
    )
    for pairs, message in checks:
        name = _first_nul(pairs)
        if name is not None:
            return message % {"name": name}, name
    # request.POST reads form bodies only. The API reads JSON alone (its parser refuses a NUL, and
    # answers a form body 415), so its bodies are left to it.
    if request.method == "POST" and not is_api(request):
        name = _first_nul(request.POST.lists())
        if name is not None:
            return gettext("The form field “%(name)s” holds a NUL character (U+0000).") % {"name": name}, name
    return None


class RefuseNul(MiddlewareMixin):
    """400 for a NUL character in the path, the query, a form field or a cookie (see the module)."""

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        found = _nul_problem(request)
        if found is None:
            return None
        detail, name = found
        return refusal(request, 400, detail, {name: [detail]} if name is not None else None)


# Error answers under /api/ ---------------------------------------------------------------------


def _status_detail(status: int, response: HttpResponseBase) -> str:
    if status == 405:
        return gettext("This method is not allowed here; allowed: %(allowed)s.") % {
            "allowed": response.headers.get("Allow") or "-"
        }
    if status == 404:
        return gettext("Nothing in the API answers at this address.")
    if status == 403:
        return gettext("This request is not allowed.")
    if status >= 500:
        return gettext("The server failed to answer this request; the failure is logged.")
    return gettext("The request was refused (HTTP %(status)s).") % {"status": status}


class JsonApiErrors(MiddlewareMixin):
    """Under /api/, an error answer (4xx, 5xx) that is not JSON is replaced by JSON with its status."""

    def process_response(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        status = response.status_code
        if status < 400 or not is_api(request):
            return response
        if response.headers.get("Content-Type", "").split(";")[0].strip() == "application/json":
            return response
        answer = JsonResponse({"detail": _status_detail(status, response)}, status=status)
        for header in ("Allow", "Retry-After", "WWW-Authenticate"):
            if header in response.headers:
                answer[header] = response.headers[header]
        return answer


# Django's error handlers ----------------------------------------------------------------------

# What a 400's own message may say: how the request was malformed, nothing of the server's.
_TOLD = (RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent, MultiPartParserError)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not is_api(request):
        return defaults.bad_request(request, exception)
    if isinstance(exception, _TOLD) and str(exception):
        detail = gettext("The request could not be read: %(reason)s") % {"reason": exception}
    else:
        detail = gettext("The request could not be read.")
    return refusal(request, 400, detail)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not is_api(request):
        return defaults.permission_denied(request, exception)
    message = exception.args[0] if exception.args and isinstance(exception.args[0], str) else ""
    return refusal(request, 403, message or gettext("This request is not allowed."))


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if not is_api(request):
        return defaults.page_not_found(request, exception)
    # A view's Http404 says what it did not find; the resolver's carries a dict of what it tried.
    message = exception.args[0] if exception.args and isinstance(exception.args[0], str) else ""
    return refusal(request, 404, message or gettext("Nothing in the API answers at this address."))


def server_error(request: HttpRequest) -> HttpResponse:
    if not is_api(request):
        return defaults.server_error(request)
    return refusal(request, 500, gettext("The server failed to answer this request; the failure is logged."))
