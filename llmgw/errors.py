"""The one error type a service raises when it refuses, and the console's way of showing it.

A service that refuses raises a `ServiceError` (or a subclass named for its app, such as
`SpecError` or `HoldError`); callers never build the answer themselves:

- `message`: the reason for people, already translated by the raiser (gettext, with the numbers);
  it is also `str(exc)`.
- `status`: the HTTP status the API answers with: 400 by default, 404 for a thing not found, 409 for
  a conflict, 429 for too many. A subclass sets it as a class attribute; an instance may override it.
- `code`: a short machine name for the refusal ("spec_invalid"), stable across languages, for
  scripts to branch on (None only where the APIs a refusal imitates give none: the batch APIs').
- `details`: optional facts beside the message, most often the fields refused (a path such as
  models[0].name, with its messages).

The API's exception handler (llmgw.api.exception_handler) renders every ServiceError as the API's
error body, {"detail": message, "code": code, "errors": details}, with the status; the console shows
one with `show_refusal`. A view catches a ServiceError itself only where it adds what the service
cannot know: a status that depends on the path (llmgw.api.refusal(exc, status=...)), a field named
by the request, a page that keeps what was typed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import messages

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = ["ServiceError", "refusal_message", "show_refusal"]


class ServiceError(Exception):
    """A refusal by a service: why (for people), the HTTP status, a machine code and details."""

    status: int = 400
    code: str | None = "refused"

    def __init__(
        self, message: str, *, details: dict[str, Any] | None = None, status: int | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = str(message)
        self.details = details
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


def refusal_message(exc: ServiceError) -> str:
    """What a page says of a refusal: the messages of the fields it names, or else its message."""
    found = [str(m) for listed in (exc.details or {}).values() if isinstance(listed, list) for m in listed]
    return " ".join(found) if found else exc.message


def show_refusal(request: HttpRequest, exc: ServiceError) -> None:
    """Put a refusal on the next page the person sees, as its error message."""
    messages.error(request, refusal_message(exc))
