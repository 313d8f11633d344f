"""Protocol translation for the /v1 gateway: Anthropic Messages and OpenAI Responses requests to
OpenAI chat completions, and chat completions (whole or streamed) back.

Pure functions and small state machines over parsed JSON: no Django, no I/O, stdlib only, since
they run on the gateway's hot path. The modules:

- `anthropic`: /v1/messages <-> chat (`messages_to_chat`, `chat_to_message`, `ChatToAnthropicStream`).
- `responses`: /v1/responses <-> chat (`responses_to_chat`, `chat_to_response`, `ChatToResponsesStream`).
- `usage`: token usage read from any of the three protocols, and counted when a stream reports none.
- `errors`: `TranslationError` and error bodies in Anthropic's and OpenAI's shapes.
"""

from __future__ import annotations

from ._common import Event, sse
from .anthropic import ChatToAnthropicStream, chat_to_message, messages_to_chat
from .errors import TranslationError, anthropic_error, openai_error
from .responses import ChatToResponsesStream, chat_to_response, responses_to_chat
from .usage import StreamUsage, Usage, usage_from_response

__all__ = [
    "ChatToAnthropicStream",
    "ChatToResponsesStream",
    "Event",
    "StreamUsage",
    "TranslationError",
    "Usage",
    "anthropic_error",
    "chat_to_message",
    "chat_to_response",
    "messages_to_chat",
    "openai_error",
    "responses_to_chat",
    "sse",
    "usage_from_response",
]
