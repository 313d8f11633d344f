"""Reading a batch's requests: what each line asks, and what is wrong with it, with its line number.

OpenAI input files (one JSON object a line: custom_id, method, url, body) are read as OpenAI's
Batch API reads them. Where its reference is explicit that a problem fails the whole batch at
validation, it does here too (the batch is `failed`, its `errors` name each line): a line that is
not JSON (invalid_json_line), a custom_id used twice (duplicate_custom_id), a url other than the
batch's endpoint (url_mismatch), a model other than the first line's (model_mismatch), an empty file
(empty_file), more lines than allowed (too_many_tasks), and a line missing what every request needs.

A line the batch can run without fails alone, answered with the refusal the gateway would give it,
and is named in `errors` as well: `stream: true` (a batch's answers are whole) and a model the key
may not use. Anthropic requests (custom_id, params) are read the same way, except that each
request may name its own model, and what Anthropic refuses for the whole batch (a custom_id used
twice or not of its form, too many requests) refuses the create call.

Nothing here touches the database or the disk: lines come in as bytes or parsed values.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_ERRORS",
    "OPENAI_ENDPOINTS",
    "Checked",
    "Problem",
    "Reading",
    "check_anthropic_request",
    "check_openai_line",
]

#: The endpoints an OpenAI batch may name, and what each is called in usage records.
OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: The errors a batch keeps; past these, one more entry says how many were left out.
MAX_ERRORS = 100
CUSTOM_ID_MAX = 512
ANTHROPIC_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Problem:
    """What is wrong with a line (or the file), as a batch's `errors` entry: code, message, param, line."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None
    fatal: bool = True  # fails the whole batch; else the line fails alone

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class Checked:
    """A line the batch keeps: its request, and the refusal it is answered with when it cannot be sent."""

    number: int
    custom_id: str
    model: str
    body: dict[str, Any]
    refusal: dict[str, Any] | None = None  # {"status", "type", "code", "message", "param"}


@dataclass
class Reading:
    """What has been read of one batch so far: custom ids seen, its model, its problems."""

    endpoint: str
    allowed_models: frozenset[str] | None = None
    same_model: bool = True  # OpenAI: every line names the first line's model
    custom_ids: set[str] = field(default_factory=set)
    model: str | None = None
    problems: list[Problem] = field(default_factory=list)
    left_out: int = 0

    @property
    def fatal(self) -> bool:
        return any(p.fatal for p in self.problems)

    def note(self, problem: Problem) -> None:
        if len(self.problems) < MAX_ERRORS:
            self.problems.append(problem)
        else:
            self.left_out += 1

    def errors(self) -> list[dict[str, Any]]:
        out = [p.as_dict() for p in self.problems]
        if self.left_out:
            out.append(
                {
                    "code": "more_errors",
                    "message": f"{self.left_out} more line(s) had errors; the first {MAX_ERRORS} are listed.",
                    "param": None,
                    "line": None,
                }
            )
        return out


def _missing(number: int, param: str) -> Problem:
    return Problem("missing_required_parameter", f"Missing required parameter: '{param}'.", number, param)


def _refusal(status: int, kind: str, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"status": status, "type": kind, "code": code, "message": message, "param": param}


def check_openai_line(reading: Reading, number: int, raw: bytes) -> Checked | None:
    """One line of an OpenAI input file: the request it holds, or None when it is blank or wrong
    (its problem noted in `reading`)."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        reading.note(Problem("invalid_json_line", "This line is not parseable as valid JSON.", number))
        return None
    if not isinstance(value, dict):
        reading.note(Problem("invalid_json_line", "This line is not a JSON object.", number))
        return None
    for name in ("custom_id", "method", "url", "body"):
        if name not in value:
            reading.note(_missing(number, name))
            return None
    custom_id, method, url, body = value["custom_id"], value["method"], value["url"], value["body"]
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > CUSTOM_ID_MAX:
        message = f"'custom_id' must be a string of 1 to {CUSTOM_ID_MAX} characters."
        reading.note(Problem("invalid_value", message, number, "custom_id"))
        return None
    if method != "POST":
        reading.note(Problem("invalid_value", "'method' must be POST.", number, "method"))
        return None
    if url != reading.endpoint:
        message = f"The url “{str(url)[:200]}” does not match the batch's endpoint “{reading.endpoint}”."
        reading.note(Problem("url_mismatch", message, number, "url"))
        return None
    if not isinstance(body, dict):
        reading.note(Problem("invalid_value", "'body' must be a JSON object.", number, "body"))
        return None
    return _request(reading, number, custom_id, body, "body.")


def check_anthropic_request(reading: Reading, number: int, value: Any) -> Checked | None:
    """One request of an Anthropic batch (its `requests` item): as check_openai_line. The caller
    refuses the create call when any problem is fatal."""
    if not isinstance(value, dict):
        reading.note(Problem("invalid_request_error", f"requests.{number - 1}: expected an object.", number))
        return None
    custom_id, params = value.get("custom_id"), value.get("params")
    if not isinstance(custom_id, str) or not ANTHROPIC_CUSTOM_ID.match(custom_id):
        message = f"requests.{number - 1}.custom_id: must be 1 to 64 letters, digits, hyphens or underscores."
        reading.note(Problem("invalid_request_error", message, number, "custom_id"))
        return None
    if not isinstance(params, dict):
        message = f"requests.{number - 1}.params: Field required (an object of Messages API parameters)."
        reading.note(Problem("invalid_request_error", message, number, "params"))
        return None
    return _request(reading, number, custom_id, params, "params.")


def _request(reading: Reading, number: int, custom_id: str, body: dict[str, Any], where: str) -> Checked | None:
    if custom_id in reading.custom_ids:
        message = f"The custom_id “{custom_id[:200]}” is used by an earlier request; each must be unique."
        reading.note(Problem("duplicate_custom_id", message, number, "custom_id"))
        return None
    reading.custom_ids.add(custom_id)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        reading.note(_missing(number, f"{where}model"))
        return None
    if reading.model is None:
        reading.model = model
    elif reading.same_model and model != reading.model:
        message = (
            f"The model “{model[:200]}” differs from the batch's model “{reading.model}”; one batch uses one model."
        )
        reading.note(Problem("model_mismatch", message, number, f"{where}model"))
        return None
    return Checked(number, custom_id, model, body, _line_refusal(reading, number, model, body, where))


def _line_refusal(reading: Reading, number: int, model: str, body: dict[str, Any], where: str) -> dict[str, Any] | None:
    """The refusal a request that fails alone gets (noted in `errors` too), or None."""
    if body.get("stream") is True:
        message = "A batch's answers are whole: “stream” must be false or left out."
        reading.note(Problem("invalid_value", message, number, f"{where}stream", fatal=False))
        return _refusal(400, "invalid_request_error", "invalid_value", message, "stream")
    allowed = reading.allowed_models
    if allowed is not None and model not in allowed:
        message = f"This API key may not use the model “{model[:200]}”."
        reading.note(Problem("model_not_allowed", message, number, f"{where}model", fatal=False))
        return _refusal(403, "permission_error", "model_not_allowed", message, "model")
    return None
