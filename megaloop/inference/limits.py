"""How much one request to tools/serve.py may ask for (its flags). Standard library only:
tools/serve.py's ``--help`` builds its flags from this without the server's packages."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestLimits:
    """Per-request limits of tools/serve.py (a request beyond one gets HTTP 400 naming it, 413
    for its size in bytes).

    Checked before any of the request runs; the message names the limit's flag."""

    max_prompts_per_request: int = 64
    """Prompts one /v1/completions request may hold (a list of texts or of token-id lists)."""
    max_n: int = 8
    """Choices per prompt (a request's ``n``)."""
    max_request_tokens: int = 32768
    """Tokens one request may occupy: the sum over its rows (every prompt, ``n`` times) of the
    prompt's tokens plus ``max_tokens``. Bounds the work (and the KV cache) of one request."""

    max_request_bytes: int = 4 * 1024 * 1024
    """Bytes of one request's body: a larger one gets HTTP 413 before it is read (by its
    Content-Length; a body sent in chunks, as soon as it passes the limit), so that reading,
    parsing and tokenizing a huge body never holds up the server."""

    def check(self) -> None:
        for name in ("max_prompts_per_request", "max_n", "max_request_tokens",
                     "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at "
                                 f"least 1")
