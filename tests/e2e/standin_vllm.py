"""A stand-in for `vllm serve` on the captured GPU hosts, which have no GPU to run vLLM on.

It takes vLLM's command line, checks VLLM_API_KEY as vLLM does, answers /health, and answers
each chat completion with a fixed number of tokens (PROMPT_TOKENS in, COMPLETION_TOKENS out),
counting them on a /metrics page under vLLM's own names. Known traffic in, known figures out.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROMPT_TOKENS = 12
COMPLETION_TOKENS = 8
FIRST_TOKEN_S = 0.05


def main(argv: list[str]) -> int:
    if argv[:1] == ["--version"]:
        print("0.11.0")
        return 0
    port = int(argv[argv.index("--port") + 1])
    host = argv[argv.index("--host") + 1]
    name = argv[argv.index("--served-model-name") + 1]
    key = os.environ.get("VLLM_API_KEY", "")
    counts = {"requests": 0, "metrics_pages": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200, b"")
            elif self.path == "/standin/counts":  # for the test: what it was asked
                with lock:
                    self.reply(200, json.dumps(counts).encode())
            elif self.path == "/metrics":
                with lock:
                    n = counts["requests"]
                    counts["metrics_pages"] += 1
                labels = f'engine="0",model_name="{name}"'
                page = (
                    f"vllm:num_requests_running{{{labels}}} 0.0\n"
                    f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
                    f"vllm:kv_cache_usage_perc{{{labels}}} 0.125\n"
                    f"vllm:prompt_tokens_total{{{labels}}} {float(n * PROMPT_TOKENS)}\n"
                    f"vllm:generation_tokens_total{{{labels}}} {float(n * COMPLETION_TOKENS)}\n"
                    f"vllm:time_to_first_token_seconds_sum{{{labels}}} {n * FIRST_TOKEN_S}\n"
                    f"vllm:time_to_first_token_seconds_count{{{labels}}} {float(n)}\n"
                )
                self.reply(200, page.encode(), "text/plain; version=0.0.4")
            else:
                self.reply(404, b"{}")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self.reply(401, b'{"error": "unauthorized"}')
                return
            if self.path != "/v1/chat/completions":
                self.reply(404, b"{}")
                return
            json.loads(body or b"{}")
            with lock:
                counts["requests"] += 1
            answer = {
                "id": f"chatcmpl-{time.time_ns()}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "one two three four"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": COMPLETION_TOKENS,
                    "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
                },
            }
            self.reply(200, json.dumps(answer).encode())

    ThreadingHTTPServer((host, port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:] if sys.argv[1:2] == ["serve"] else sys.argv[1:]))
