"""Accuracy on held-out demo-corpus problems by task family and by k, at an inference depth.

The problems (``tools/make_demo_corpus.py --tasks-output``: arithmetic chains, k-hop variable
binding, pointer chasing; ``family``, ``k``, ``question`` ending in ``answer:``, ``answer``) are
scored the way the corpus writes them: the sequence ``question + " " + answer``, teacher-forced,
is correct when the model's argmax at every answer position is the answer's token, which is
exactly when greedy decoding after the question writes the answer. The answer's tokens are the
tail of the whole sequence's tokens after the question's (lm-eval's causal-LM split), so a
tokenizer that merges across the boundary is handled. This is the analogue of the reasoning-depth
axes of "What Makes Recurrence Effective in Looped Language Models?" (ProofWriter depth, CLUTRR
chain length) on the demo corpus.
"""

from __future__ import annotations

import json
from collections import defaultdict

import torch


def read_tasks(path: str, limit: int = 0) -> list[dict]:
    """The problems of a --tasks-output JSONL (first ``limit`` if > 0); ValueError by line."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                item = {k: item[k] for k in ("family", "k", "question", "answer")}
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a task line (family, k, question, "
                                 f"answer), as tools/make_demo_corpus.py --tasks-output writes"
                                 ) from None
            items.append(item)
            if limit and len(items) == limit:
                break
    if not items:
        raise ValueError(f"{path}: no task lines")
    return items


def encode(items: list[dict], tokenizer, max_length: int) -> list[tuple[list[int], int]]:
    """(token ids of question + answer, number of answer tokens) per item."""
    out = []
    for item in items:
        context = tokenizer.tokenize(item["question"])
        whole = tokenizer.tokenize(f"{item['question']} {item['answer']}")
        n = len(whole) - len(context)
        if n < 1:
            raise ValueError(f"task {item['question']!r}: its answer adds no token")
        if len(whole) > max_length + 1:
            raise ValueError(f"a task of {len(whole)} tokens is longer than the model's "
                             f"{max_length}-token context; shorten the task file's problems")
        out.append((whole, n))
    return out


@torch.no_grad()
def accuracy(model, encoded: list[tuple[list[int], int]], items: list[dict], depth: int,
             vocab_size: int, batch_size: int = 16) -> dict:
    """{"overall": acc, "by_family": {family: {k: acc}}, "count": {family: {k: n}}}."""
    from megaloop.device import current_device
    from megaloop.inference.early_exit import exit_log_probs

    device = current_device()
    hits = defaultdict(lambda: defaultdict(int))
    counts = defaultdict(lambda: defaultdict(int))
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        width = max(len(ids) - 1 for ids, _ in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (ids, _) in enumerate(chunk):
            x[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        x = x.to(device)
        pos = torch.arange(width, device=device).expand_as(x)
        logp, _ = exit_log_probs(model, x, pos, depth, None, vocab_size)
        guess = logp.argmax(-1).cpu()
        for i, (ids, n) in enumerate(chunk):
            item = items[start + i]
            first = len(ids) - 1 - n  # input position predicting the first answer token
            ok = guess[i, first:first + n].tolist() == ids[-n:]
            hits[item["family"]][item["k"]] += int(ok)
            counts[item["family"]][item["k"]] += 1
    total = sum(sum(c.values()) for c in counts.values())
    return {"overall": sum(sum(h.values()) for h in hits.values()) / max(total, 1),
            "by_family": {f: {k: hits[f][k] / counts[f][k] for k in sorted(counts[f])}
                          for f in sorted(counts)},
            "count": {f: dict(sorted(counts[f].items())) for f in sorted(counts)}}
