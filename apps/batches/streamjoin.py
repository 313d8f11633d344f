"""A streamed chat or text completion joined back into the answer the same request gets unstreamed.

Why lines are streamed at all: a line gives way to an interactive request by going away (its
connection to the engine is closed). llama.cpp's server notices a client gone from a streamed
answer at its next token, but from an unstreamed one only when it next polls the connection (once a
second): the slot the interactive request was promised stays busy up to a second more. Measured
here with Gemma 3 270M on one slot: the next request's first token 543-551 ms after an unstreamed
request was cut off, 60-74 ms after a streamed one. So the runner asks the gateway for a stream
(with the usage at its end) and writes the joined answer in the output file, as OpenAI's batches do.

`join` reads the server-sent events as the gateway relays them (OpenAI's chunk shapes): it
concatenates each choice's content, reasoning, refusal, log probabilities and tool-call pieces (by
their index), keeps the finish reasons, the usage and the first chunk's id, model, created and
system fingerprint. It refuses (None and why) a stream that says it failed or that ended before
every choice had finished: such a try did not complete, and is not written as an answer.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["STREAMED", "join"]

#: The endpoints whose lines are sent streamed and joined (embeddings have no stream; Responses and
#: Anthropic's messages are sent as they are).
STREAMED = frozenset({"/v1/chat/completions", "/v1/completions"})


class _Choice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.role = "assistant"
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.logprobs: list[Any] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None

    def add(self, choice: dict[str, Any], text_api: bool) -> None:
        part = choice if text_api else choice.get("delta") or {}
        if not isinstance(part, dict):
            return
        if isinstance(part.get("role"), str):
            self.role = part["role"]
        for key, into in (("text" if text_api else "content", self.text), ("reasoning_content", self.reasoning)):
            if isinstance(part.get(key), str):
                into.append(part[key])
        if isinstance(part.get("refusal"), str):
            self.refusal.append(part["refusal"])
        for call in part.get("tool_calls") or []:
            if isinstance(call, dict):
                self._tool(call)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            self.logprobs.extend(logprobs["content"])
        if isinstance(choice.get("finish_reason"), str):
            self.finish = choice["finish_reason"]

    def _tool(self, call: dict[str, Any]) -> None:
        named = call.get("index")
        index = named if isinstance(named, int) else len(self.tools)
        held = self.tools.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if isinstance(call.get("id"), str):
            held["id"] = call["id"]
        if isinstance(call.get("type"), str):
            held["type"] = call["type"]
        function = call.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    held["function"][key] += function[key]

    def whole(self, text_api: bool) -> dict[str, Any]:
        logprobs = {"content": self.logprobs} if self.logprobs else None
        if text_api:
            return {"index": self.index, "text": "".join(self.text), "logprobs": logprobs, "finish_reason": self.finish}
        content = "".join(self.text) if self.text or not self.tools else None
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.tools:
            message["tool_calls"] = [self.tools[k] for k in sorted(self.tools)]
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish}


def _events(raw: bytes) -> tuple[list[Any], bool]:
    """The JSON of each `data:` event, and whether `data: [DONE]` ended the stream."""
    events: list[Any] = []
    done = False
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            events.append(json.loads(data))
        except ValueError:
            events.append(None)
    return events, done


def join(endpoint: str, raw: bytes) -> tuple[bytes | None, str | None]:
    """The unstreamed answer's JSON, or None and why the stream is not a whole answer."""
    text_api = endpoint == "/v1/completions"
    events, done = _events(raw)
    head: dict[str, Any] = {}
    usage: Any = None
    choices: dict[int, _Choice] = {}
    for event in events:
        if not isinstance(event, dict):
            return None, "the stream held an event that is not JSON"
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            return None, f"the stream ended with an error: {str(message)[:300]}"
        for key in ("id", "model", "created", "system_fingerprint"):
            if key in event and key not in head:
                head[key] = event[key]
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
        for choice in event.get("choices") or []:
            if isinstance(choice, dict):
                named = choice.get("index")
                index = named if isinstance(named, int) else 0
                choices.setdefault(index, _Choice(index)).add(choice, text_api)
    if not done or not choices or any(c.finish is None for c in choices.values()):
        return None, "the stream ended before the answer was complete"
    answer = {
        "id": head.get("id", ""),
        "object": "text_completion" if text_api else "chat.completion",
        "created": head.get("created", 0),
        "model": head.get("model", ""),
        "choices": [choices[k].whole(text_api) for k in sorted(choices)],
        "usage": usage,
    }
    if head.get("system_fingerprint") is not None:
        answer["system_fingerprint"] = head["system_fingerprint"]
    return json.dumps(answer, ensure_ascii=False).encode(), None
