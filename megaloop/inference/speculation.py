"""Lossless self-speculative decoding: the looped model's first d steps draft, all T verify.

One round for the engine's decoding rows (``--speculate d:k``):

1. draft: k forwards of one token each at depth d (no exit rule: the shallow model is the
   first d loop steps, read out as the trained readout reads any step), each drafting the next
   token, greedy or sampled from the depth-d distribution q;
2. verify: one forward at depth T over the last accepted token and the k drafts, which gives
   the depth-T distribution p at each of the k + 1 positions and overwrites the drafts' cache
   entries with depth-T ones (all T steps' K/V of those positions);
3. accept: greedy rows keep the drafts while each equals the depth-T argmax; sampled rows keep
   draft x with probability min(1, p(x) / q(x)) (the standard speculative-sampling rule), and
   at the first rejection draw from the normalised max(p - q, 0); a row that keeps all k drafts
   draws one more token from p at the last position. Every row thus emits 1 to k + 1 tokens
   per round, distributed exactly as depth-T decoding's (tests/test_speculation.py);
4. roll back: a row's cached length counts the tokens it kept; the K/V written for rejected
   drafts sits past it and is overwritten by the next round.

A draft reads out at step d, so its coda attends to the coda's cache of step d, which a forward
returning step T's logits never writes: the engine's prefill and the verify also read out at
step d (``full_depth_forward``; one more coda and head pass), or the drafts would attend to
an unwritten cache for the prompt and for a round's last kept draft.

Each row's draws come from its counter-based stream (megaloop/inference/sampling.py): the
uniform of role r (draft, accept, final draw) for its n-th generated token is the stream's
counter 3n + r, so a row's draws do not depend on its batch-mates. (Its sampled tokens do
near a batch-mate's end: k is the least room of a round's rows, and with a smaller k a token
is drawn in another role; their distribution is depth T's all the same, and a greedy row's
tokens are depth T's exactly.) The cache must keep every
loop step's K/V of every token (``full``): the one-slot and mod-k policies make a multi-token
verify differ from token-by-token decoding. An exit rule is refused with it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megaloop.device import current_device
from megaloop.inference.sampling import draw, probabilities, stream_uniforms
from megaloop.model import recurrence

DRAFT, ACCEPT, FINAL = 0, 1, 2


def parse_speculate(text: str, num_loops: int = 0):
    """``d:k`` -> (d, k), or None for ""; ValueError naming --speculate otherwise (d < T when
    ``num_loops`` T is given)."""
    if not text:
        return None
    try:
        d, k = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"--speculate {text!r}: give d:k (draft depth d, k drafted tokens per "
                         f"round), e.g. 2:4") from None
    if d < 1 or k < 1:
        raise ValueError(f"--speculate {text}: the draft depth and the drafted tokens must be "
                         f">= 1")
    if num_loops and d >= num_loops:
        raise ValueError(f"--speculate {text}: the draft depth {d} must be below the decoding "
                         f"depth {num_loops} (--num-loops)")
    return d, k


def check_speculate(text: str, exit_rule, kv_policy: str, num_loops: int = 0):
    """``parse_speculate``, and refuse what speculation cannot run with (by flag)."""
    spec = parse_speculate(text, num_loops)
    if spec and exit_rule is not None:
        raise ValueError(f"--speculate {text} and --exit: choose one (early exit changes the "
                         f"distribution speculation must keep)")
    if spec and kv_policy != "full":
        raise ValueError(f"--speculate {text} needs --kv-policy full (a multi-token verify over "
                         f"one-slot or mod-k caches differs from token-by-token decoding)")
    return spec


@dataclass
class _DraftCacheContext(recurrence.StepContext):
    """A forward's step context that also reads out at the draft depth (its logits unused)."""

    draft_depth: int = 0

    def reads_out(self, t: int) -> bool:
        return t == self.draft_depth or super().reads_out(t)


def full_depth_forward(model, ids, positions, mask, num_loops, kv, draft_depth: int):
    """``model(ids, positions, mask, num_loops=num_loops, kv_cache=kv)``'s logits, the coda's
    cache of step ``draft_depth`` written for these positions as well (module docstring)."""
    ctx = recurrence.context(model, ids, mask, None, num_loops, kv)
    ctx = _DraftCacheContext(**{f.name: getattr(ctx, f.name) for f in fields(ctx)},
                             draft_depth=draft_depth)
    return recurrence.fold(model, recurrence.begin(model, ids, positions, ctx), ctx)


def _logits(model, ids, positions, mask, num_loops, kv, vocab_size, draft_depth=None):
    from megatron.core import tensor_parallel

    if draft_depth is None:  # a draft
        logits = model(ids, positions, mask, num_loops=num_loops, kv_cache=kv)
    else:
        logits = full_depth_forward(model, ids, positions, mask, num_loops, kv, draft_depth)
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :vocab_size].float()


def speculate_round(engine, requests: list, k: int):
    """Draft k tokens per row at depth d, verify at depth T and accept (module docstring).
    Returns the [b, k + 1, V] depth-T logits, per row the emitted ids and whether its logits
    could be sampled, and the drafted and accepted counts; the rows' caches hold the kept
    tokens."""
    d = engine.speculate[0]
    model, paged = engine.model, engine.kv
    params = [r.params for r in requests]
    temp, top_k, top_p = ([p.temperature for p in params], [p.top_k for p in params],
                          [p.top_p for p in params])
    seeds, streams = [p.seed for p in params], [r.stream for r in requests]
    made = [len(r.out) for r in requests]
    rows = [(r.blocks, r.cached) for r in requests]
    lengths = torch.tensor([r.cached for r in requests])
    kv, _ = paged.view(rows, k + 1)
    base = kv.offset
    device = current_device()
    greedy = torch.tensor([t <= 0 for t in temp], device=device)

    def uniform(j, role):
        return stream_uniforms(seeds, streams, [3 * (n + j) + role for n in made], device)

    fed = torch.tensor([[r.out[-1]] for r in requests], device=device)
    drafts, q = [], []
    for j in range(k):  # 1. draft at depth d
        kv.context.sequence_len_offset = base + j
        logits = _logits(model, fed, (lengths + j).view(-1, 1).to(device),
                         paged.mask(lengths + j, base + j, 1), d, kv, engine.vocab_size)[:, -1]
        probs, _ = probabilities(logits, temp, top_k, top_p)
        token = torch.where(greedy, logits.argmax(-1), draw(probs, uniform(j, DRAFT)))
        drafts.append(token)
        q.append(probs)
        fed = token[:, None]
    # 2. verify: the last kept token and the drafts, all T steps
    kv.context.sequence_len_offset = base
    ids = torch.cat([torch.tensor([[r.out[-1]] for r in requests], device=device),
                     torch.stack(drafts, 1)], 1)
    positions = (lengths.view(-1, 1) + torch.arange(k + 1)).to(device)
    logits = _logits(model, ids, positions, paged.mask(lengths, base, k + 1), engine.num_loops,
                     kv, engine.vocab_size, draft_depth=d)
    paged.write_back(kv, rows, k + 1)
    # 3. accept, position by position (a row stops at its first rejection)
    b = len(requests)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    kept = torch.zeros(b, dtype=torch.long, device=device)
    final = torch.zeros(b, dtype=torch.long, device=device)
    broken = ~torch.isfinite(logits).any(-1).all(-1)  # a row with no finite logit somewhere
    for j in range(k + 1):
        target = logits[:, j]
        p, bad = probabilities(target, temp, top_k, top_p)
        broken |= bad & ~greedy
        if j < k:
            x = drafts[j]
            px, qx = p.gather(1, x[:, None]).squeeze(1), q[j].gather(1, x[:, None]).squeeze(1)
            ok = torch.where(greedy, x == target.argmax(-1),
                             uniform(j, ACCEPT) * qx < px)
            # the rejected rows' draw: from max(p - q, 0), normalised (greedy: the argmax)
            residual = (p - q[j]).clamp(min=0)
        else:
            ok = torch.zeros(b, dtype=torch.bool, device=device)
            residual = p
        empty = residual.sum(-1) <= 0  # p == q exactly: any draw from p is right
        residual = torch.where(empty[:, None], p, residual)
        picked = torch.where(greedy, target.argmax(-1), draw(residual, uniform(j, FINAL)))
        stop = alive & ~ok
        final = torch.where(stop, picked, final)
        kept = kept + (alive & ok).long()
        alive = alive & ok
    out = torch.cat([torch.stack(drafts, 1), final[:, None], kept[:, None],
                     broken[:, None].long()], 1).tolist()  # the one transfer to the host
    emitted = [row[:row[-2]] + [row[k]] for row in out]
    for r, row in zip(requests, emitted):
        r.cached += len(row)  # the fed token and the kept drafts (the last one is fed next)
    ok = [not row[-1] for row in out]
    return logits, emitted, ok, b * k, sum(len(row) - 1 for row in emitted)
