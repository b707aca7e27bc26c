"""Instruction examples -> segments -> tokens + loss mask (the layout is described in
megaloop/data/sft.py). Standard library only: preprocessing imports this without torch.
"""

from __future__ import annotations

from typing import Any

ASSISTANT = "assistant"

# A segment of an example: (text, counts_for_loss, followed_by_eod).
Segment = tuple[str, bool, bool]


def sft_segments(example: Any) -> list[Segment]:
    """Split one parsed JSONL example into segments; ValueError says what is wrong with it."""
    if not isinstance(example, dict):
        raise ValueError("expected a JSON object with prompt/response or messages")
    if "messages" in example:
        messages = example["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content}")
        segments = []
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ValueError(f"messages[{i}] must be an object with string role and content")
            is_response = m["role"] == ASSISTANT
            segments += [(m["role"] + ":", False, False), (m["content"], is_response, is_response)]
        return segments
    if isinstance(example.get("prompt"), str) and isinstance(example.get("response"), str):
        return [(example["prompt"], False, False), (example["response"], True, True)]
    raise ValueError("expected string 'prompt' and 'response' keys, or a 'messages' list")


def assemble(segments: list[Segment], encoded: list[list[int]], eod: int
             ) -> tuple[list[int], list[int]]:
    """Tokens and aligned loss mask of one example from its segments' encodings."""
    tokens: list[int] = []
    mask: list[int] = []
    for (_, is_response, eod_after), ids in zip(segments, encoded):
        tokens += ids
        mask += [int(is_response)] * len(ids)
        if eod_after:
            tokens.append(eod)
            mask.append(int(is_response))
    return tokens, mask
