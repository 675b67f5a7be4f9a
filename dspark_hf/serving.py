"""A client for an OpenAI-compatible chat endpoint (vLLM, SGLang, TGI all serve `POST /v1/chat/completions`).

Regenerating 100k conversations with a big target is a serving job: the engine batches concurrent requests, applies
the target's chat template and samples. This client sends one conversation's messages per request and gets the
reply back; retries with exponential backoff what a busy or restarting server answers (connection errors, 429,
5xx), a bounded number of times, then stops with one line naming the server and the fix. Anything else (4xx, a body
that is not the OpenAI shape) is an error at once: retrying cannot fix it.
"""

from __future__ import annotations

import json
import time

import httpx2 as httpx  # the HTTP client huggingface_hub depends on

RETRY_STATUS = (429, 500, 502, 503, 504)


def chat_completions_url(server: str) -> str:
    """`http://host:8000`, `http://host:8000/` or `http://host:8000/v1` -> `http://host:8000/v1/chat/completions`."""
    base = server.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--server {server!r} is not an http(s) URL; pass the server's base URL, e.g. --server http://localhost:8000")
    return base.removesuffix("/v1") + "/v1/chat/completions"


class ChatServer:
    """`complete(messages, **sampling)` against one OpenAI-compatible server; safe to share between threads."""

    def __init__(self, server: str, model: str, *, retries: int = 5, backoff: float = 1.0, max_backoff: float = 30.0,
                 timeout: float = 600.0, concurrency: int = 8):
        self.url = chat_completions_url(server)
        self.model = model
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.Client(timeout=timeout, limits=limits)

    def close(self) -> None:
        self.http.close()

    def complete(self, messages: list[dict], **sampling) -> tuple[str, int | None]:
        """The assistant's reply to `messages` and the tokens it took (`usage.completion_tokens`, when sent)."""
        response = self._post({"model": self.model, "messages": messages, **sampling})
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(
                f"server {self.url} answered with malformed JSON ({response.text[:80]!r}); check that --server points "
                "at an OpenAI-compatible server (vLLM, SGLang, TGI)"
            ) from None
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise ValueError(
                f"server {self.url} answered without choices[0].message.content ({json.dumps(body)[:120]}); check "
                "that --server points at an OpenAI-compatible chat endpoint (vLLM, SGLang, TGI)"
            )
        usage = body.get("usage") if isinstance(body, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return content, tokens if isinstance(tokens, int) else None

    def _post(self, payload: dict) -> httpx.Response:
        """POST, retrying up to `retries` times; retry k waits backoff · 2^(k-1) seconds, or what the server's
        Retry-After asks, at most `max_backoff`."""
        problem, asked = "", 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(max(asked, self.backoff * 2 ** (attempt - 1)), self.max_backoff))
            try:
                response = self.http.post(self.url, json=payload)
            except httpx.TransportError as error:
                problem, asked = f"{type(error).__name__}: {error}", 0.0
                continue
            if response.status_code in RETRY_STATUS:
                problem, asked = f"HTTP {response.status_code}", _seconds(response.headers.get("retry-after"))
                continue
            if response.status_code >= 400:
                raise ValueError(
                    f"server {self.url} refused the request (HTTP {response.status_code}: {response.text[:160]!r}); "
                    f"check --server and --model-name {self.model!r} (the name the server serves)"
                )
            return response
        raise ConnectionError(
            f"server {self.url} failed {self.retries + 1} times in a row (last: {problem}); check that it is running and "
            f"serving {self.model!r} (e.g. `vllm serve {self.model}`), then rerun the same command to resume"
        )


def _seconds(value: str | None) -> float:
    try:
        return max(float(value), 0.0) if value else 0.0
    except ValueError:  # an HTTP date: ignore, use the backoff
        return 0.0


__all__ = ["ChatServer", "chat_completions_url"]
