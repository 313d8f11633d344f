"""Counting a chat request's prompt with the engine's own tokenizer, after its chat template.

- llama.cpp's llama-server: POST /apply-template with the chat body gives the prompt text as
  the template renders it (tools included), POST /tokenize of that text (special tokens
  parsed, BOS added as the completion would) gives its tokens. Both are answered by the HTTP
  thread, not a slot, so they are quick while every slot is busy.
- vLLM (and SGLang, which copies its API): POST /tokenize with the model and the messages
  answers {"count": N}.
- An external provider has no such call: None.

Used by /v1/messages/count_tokens, for the real input_tokens of an Anthropic stream's
message_start, and to charge a stream the client cancelled before the engine reported usage.
`estimate_prompt_tokens` is the fallback when nothing can count: a quarter of the text's
characters, which is what such records say they are (tokens_estimated). The fair queue charges a
request by it before any engine counts. An audio part (`input_audio`, base64) is counted by its
length in time, not as text: AUDIO_BYTES_PER_TOKEN of decoded audio a token (25 tokens a second,
as the audio encoders of Qwen2-Audio and Whisper-based models pool their frames, of audio
compressed to 128 kbit/s; uncompressed 16 kHz audio is estimated at twice its tokens). Its
base64 counted as text made a minute of speech 320,000 tokens, and its key last in the queue.
Images are not counted.
"""

from __future__ import annotations

import json
import math
from typing import Any

from apps.gateway.intake import engine_json, text_size
from apps.gateway.tables import Upstream
from apps.gateway.upstream import Pool

__all__ = ["count_prompt_tokens", "estimate_prompt_tokens"]

_CHAT_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "response_format")


async def _post(pool: Pool, upstream: Upstream, path: str, body: dict[str, Any]) -> Any:
    headers = [("Content-Type", "application/json")]
    secret = upstream.api_key()
    if secret:
        headers.append(("Authorization", f"Bearer {secret}"))
    response = await pool.post(upstream.url + path, engine_json(body), headers)
    async with response:
        raw = await response.read()
        if response.status != 200:
            return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


async def count_prompt_tokens(pool: Pool, upstream: Upstream, chat: dict[str, Any]) -> int | None:
    """The prompt's tokens as the engine will count them, or None when it cannot say."""
    if upstream.engine == "external":
        return None
    if "messages" not in chat:
        prompt = chat.get("prompt")
        if not isinstance(prompt, str):
            return None
        return await _tokenize_text(pool, upstream, prompt, add_special=True)
    body = {k: chat[k] for k in _CHAT_FIELDS if k in chat}
    if upstream.engine == "llama.cpp":
        rendered = await _post(pool, upstream, "/apply-template", body)
        if not isinstance(rendered, dict) or not isinstance(rendered.get("prompt"), str):
            return None
        return await _tokenize_text(pool, upstream, rendered["prompt"], add_special=True)
    answer = await _post(
        pool, upstream, "/tokenize", {"model": upstream.upstream_model, **body, "add_generation_prompt": True}
    )
    count = answer.get("count") if isinstance(answer, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


async def _tokenize_text(pool: Pool, upstream: Upstream, text: str, *, add_special: bool) -> int | None:
    if upstream.engine == "llama.cpp":
        answer = await _post(
            pool, upstream, "/tokenize", {"content": text, "add_special": add_special, "parse_special": True}
        )
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return len(tokens) if isinstance(tokens, list) else None
    answer = await _post(pool, upstream, "/tokenize", {"model": upstream.upstream_model, "prompt": text})
    count = answer.get("count") if isinstance(answer, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


#: Fields whose text is no part of the prompt's length.
_NOT_TEXT = frozenset(("image_url", "type", "role", "input_audio"))
#: Bytes of decoded audio a token: 16,000 bytes a second (128 kbit/s) at 25 tokens a second.
AUDIO_BYTES_PER_TOKEN = 640


def estimate_prompt_tokens(chat: dict[str, Any]) -> int:
    """A rough count when no tokenizer answers: four characters a token, and the audio parts by
    their length in time; at least one."""
    text = sum(text_size(chat.get(part), skip=_NOT_TEXT) for part in ("messages", "prompt", "tools"))
    return max(1, math.ceil(text / 4) + math.ceil(_audio_bytes(chat.get("messages")) / AUDIO_BYTES_PER_TOKEN))


def _audio_bytes(messages: Any) -> int:
    """Decoded bytes of the messages' `input_audio` parts (base64: three bytes per four characters)."""
    total = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            audio = part.get("input_audio") if isinstance(part, dict) else None
            data = audio.get("data") if isinstance(audio, dict) else None
            if isinstance(data, str):
                total += len(data) * 3 // 4
    return total
