"""A request's token estimate (the fair queue's charge before any engine counts, and the usage record's
when none does) counts an audio part by its length in time, not its base64 as text."""

from __future__ import annotations

import base64

from apps.gateway.tokens import AUDIO_BYTES_PER_TOKEN, estimate_prompt_tokens


def _audio_chat(seconds: float, text: str = "What is said here?") -> dict[str, object]:
    audio = base64.b64encode(bytes(int(seconds * 16_000))).decode()  # 128 kbit/s
    return {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "input_audio", "input_audio": {"data": audio, "format": "mp3"}},
                ],
            }
        ],
    }


def test_a_minute_of_speech_is_charged_as_a_minute_not_as_its_base64() -> None:
    estimate = estimate_prompt_tokens(_audio_chat(60))
    assert estimate == 5 + 60 * 16_000 // AUDIO_BYTES_PER_TOKEN  # the text's 18 characters, and 25 tokens a second
    assert estimate < 2_000  # its base64 as text: 1,280,000 characters, 320,000 tokens


def test_text_is_counted_as_before_beside_an_audio_part() -> None:
    short, long = estimate_prompt_tokens(_audio_chat(1, "a" * 40)), estimate_prompt_tokens(_audio_chat(1, "a" * 400))
    assert long - short == 90


def test_a_malformed_audio_part_counts_nothing_and_raises_nothing() -> None:
    parts = [{"type": "input_audio", "input_audio": "not a dict"}, {"type": "input_audio", "input_audio": {"data": 7}}]
    chat = {"model": "m", "messages": [{"role": "user", "content": parts}, {"role": "user", "content": None}, 7]}
    assert estimate_prompt_tokens(chat) == 1
