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

Whether a round pays: ``DraftController`` below picks each round's k from the measured
acceptance and forward costs (k = 0: decode plainly), and benchmarks/speculation_bound.py
measures the best speed-up a model can reach on a machine. Neither changes the rule of step 3:
any k keeps the depth-T distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch

from megaloop.device import current_device
from megaloop.inference.flags import parse_speculate  # noqa: F401  (its home: the light flags)
from megaloop.inference.sampling import draw, probabilities, stream_uniforms
from megaloop.model import recurrence

DRAFT, ACCEPT, FINAL = 0, 1, 2




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
    from megaloop.model.readout import gather_logits

    if draft_depth is None:  # a draft
        logits = model(ids, positions, mask, num_loops=num_loops, kv_cache=kv)
    else:
        logits = full_depth_forward(model, ids, positions, mask, num_loops, kv, draft_depth)
    logits = gather_logits(logits)
    return logits[..., :vocab_size].float()


def speculate_round(engine, requests: list, k: int, times: Optional[dict] = None):
    """Draft k tokens per row at depth d, verify at depth T and accept (module docstring).
    Returns the [b, k + 1, V] depth-T logits, per row the emitted ids and whether its logits
    could be sampled, and the drafted and accepted counts; the rows' caches hold the kept
    tokens. ``times``: a dict given here gets the round's seconds, ``draft_s`` (the k draft
    forwards and their sampling) and ``verify_s`` (the verify, the acceptance and the transfer
    of the round's ids to the host) (``_PhaseClock``)."""
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

    clock = _PhaseClock() if times is not None else None
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
    if clock is not None:
        clock.mark()
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
    if clock is not None:
        times["draft_s"], times["verify_s"] = clock.seconds()
    emitted = [row[:row[-2]] + [row[k]] for row in out]
    for r, row in zip(requests, emitted):
        r.cached += len(row)  # the fed token and the kept drafts (the last one is fed next)
    ok = [not row[-1] for row in out]
    return logits, emitted, ok, b * k, sum(len(row) - 1 for row in emitted)


class _PhaseClock:
    """Seconds of a round's two phases: the drafts (from construction to ``mark``) and the rest
    (``mark`` to ``seconds``, called once the round's ids have reached the host). On a GPU the
    host's clock at ``mark`` says when the drafts' kernels were queued, not when they ran: there
    the drafts' seconds are CUDA events' (recorded in the stream, read after the transfer has
    synchronised, so timing adds no synchronisation), and the rest is the round's wall-clock
    minus them."""

    def __init__(self):
        self.start = time.perf_counter()
        self.events = None
        if torch.cuda.is_available():
            self.events = [torch.cuda.Event(enable_timing=True)]
            self.events[0].record()

    def mark(self) -> None:
        self.marked = time.perf_counter()
        if self.events is not None:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[1].record()

    def seconds(self) -> tuple[float, float]:
        total = time.perf_counter() - self.start
        if self.events is None:
            first = self.marked - self.start
        else:
            first = self.events[0].elapsed_time(self.events[1]) / 1e3  # (milliseconds)
        return first, total - first


def expected_tokens(a: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): the tokens a row emits in a round of k drafts when each
    draft is kept with probability a, independently ("Fast Inference from Transformers via
    Speculative Decoding", Leviathan et al. 2023, section 3.3, equation 1); k + 1 at a = 1."""
    return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


class DraftController:
    """Each round's number of drafts k in 0..max_k: the one expected to emit the most tokens per
    second, from the acceptance and the forward costs measured as the engine runs (k = 0: decode
    this step plainly).

    With each draft kept with probability a, independently of the others (the standard
    analysis's assumption: "Fast Inference from Transformers via Speculative Decoding",
    Leviathan et al. 2023, section 3), a round of k drafts emits E(k) = (1 - a^(k+1)) / (1 - a)
    tokens per row (``expected_tokens``) and takes k c_draft + c_verify seconds, while a plain
    step emits one token in c_plain; so k maximises

        rate(k) = E(k) / (k c_draft + c_verify)  (k >= 1),    rate(0) = 1 / c_plain.

    rate(k) c_plain is the paper's walltime improvement factor (its Theorem 3.8),
    E(k) / (k c + 1) with c = c_draft / c_plain, except that the verify's cost is measured
    instead of taken as one plain forward: it runs k + 1 tokens and also reads out at the draft
    depth (``full_depth_forward``).

    a: the kept drafts over the tested ones (a row's drafts are tested up to its first
    rejection: kept + 1 if it rejected one, k if it kept all), the maximum-likelihood estimate
    of a per-draft rate. Accepted / drafted would underestimate it: a row that rejects its first
    draft never tests the other k - 1 (at a = 0.5 and k = 4, accepted / drafted is 0.23). Both
    counts are exponential moving averages over rounds, weight ``decay`` on the newest, so the
    estimate follows a text whose drafts get easier or harder.

    Costs: wall-clock seconds measured by the engine (``record``, ``record_plain``), averaged
    likewise; not derived from the depths (a draft at depth d as d/T of a full forward), since a
    small model's forward is mostly host overhead (on the demo model on CPU a draft costs about
    what a full forward does) and a (k + 1)-token verify costs about one forward only while
    reading the weights dominates; measured, they hold on whatever machine runs. The verify's
    cost is taken as the same for every k (measured at the k in use): true in the regime where
    speculation can pay, small batches, whose forward over k + 1 <= 9 tokens costs about one
    token's. A cost grows with the batch; the controller keeps one average of each.

    Measuring first: until a plain step has been timed ``k_for`` says 0, then until a round has,
    ``max_k``. Probing: after ``probe_every`` plain steps in a row it says the best k >= 1 once
    (so that a recovered acceptance is noticed), after ``probe_every`` rounds in a row 0 once
    (so that c_plain follows the batch).

    Lossless: k only sets how many drafts a round makes, never the rule that keeps them: every
    round, of any k, and every plain step emits tokens distributed as depth-T decoding's (module
    docstring). A sampled row's tokens under a given seed do depend on the k of its rounds, which
    follows the clock here (as it follows the batch's room: module docstring); a greedy row's
    tokens do not.

    Under tensor parallelism each rank times its own forwards: the engine must run one rank's k
    on all of them (``agreed_k``), or the ranks' forwards differ."""

    def __init__(self, decay: float = 0.2, probe_every: int = 16):
        if not 0 < decay <= 1:
            raise ValueError(f"DraftController decay {decay}: must be in (0, 1] (the newest "
                             f"round's weight in the moving averages)")
        if probe_every < 1:
            raise ValueError(f"DraftController probe_every {probe_every}: must be >= 1")
        self.decay, self.probe_every = decay, probe_every
        self.kept = self.tested = None  # averaged drafts kept / tested per round
        self.c_plain = self.c_draft = self.c_verify = None  # averaged seconds per forward
        self.plain_run = self.round_run = 0  # plain steps / rounds in a row, up to now

    def _average(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.decay * (new - old)

    @property
    def acceptance(self) -> Optional[float]:
        """The estimated probability a that a draft is kept (None before the first round)."""
        return None if self.tested is None else self.kept / self.tested

    def rate(self, k: int) -> float:
        """Expected tokens per second of one row in a step of k drafts (0: a plain step)."""
        if k == 0:
            return 1.0 / self.c_plain
        return expected_tokens(self.acceptance, k) / (k * self.c_draft + self.c_verify)

    def best(self, ks) -> int:
        """The k of ``ks`` with the highest ``rate`` (the smallest of equal ones)."""
        return max(ks, key=self.rate)

    def k_for(self, max_k: int) -> int:
        """The drafts of the next round, 0..``max_k`` (the round's least room and the flag's
        k); 0: decode this step plainly."""
        if max_k < 1 or self.c_plain is None:
            return 0
        if self.c_draft is None:
            return max_k
        k = self.best(range(max_k + 1))
        if k == 0 and self.plain_run >= self.probe_every:
            return self.best(range(1, max_k + 1))
        if k > 0 and self.round_run >= self.probe_every:
            return 0
        return k

    def record(self, kept: Sequence[int], k: int, seconds_draft: float,
               seconds_verify: float) -> None:
        """A round of ``k`` drafts: per row the drafts it kept (0..k), the seconds of the k
        draft forwards and of the verify (``speculate_round``'s ``times``)."""
        if k < 1 or not kept or any(not 0 <= n <= k for n in kept):
            raise ValueError(f"DraftController.record: k {k} and kept {list(kept)}: a round has "
                             f"k >= 1 drafts, at least one row, and each row keeps 0..k")
        self.kept = self._average(self.kept, sum(kept))
        self.tested = self._average(self.tested, sum(n + (n < k) for n in kept))
        self.c_draft = self._average(self.c_draft, seconds_draft / k)
        self.c_verify = self._average(self.c_verify, seconds_verify)
        self.round_run, self.plain_run = self.round_run + 1, 0

    def record_plain(self, seconds: float) -> None:
        """A plain decode step (one forward at full depth, its sampling) took ``seconds``."""
        self.c_plain = self._average(self.c_plain, seconds)
        self.plain_run, self.round_run = self.plain_run + 1, 0


def agreed_k(k: int) -> int:
    """``k`` of the tensor-parallel group's first rank, on every rank of the group: each rank's
    DraftController times its own forwards, so their choices can differ, and a round's forwards
    must be the same on all. One broadcast of one integer per round, and its wait; none at
    TP=1."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return k
    box = torch.tensor([k], device=current_device())
    torch.distributed.broadcast(box, parallel_state.get_tensor_model_parallel_src_rank(),
                                group=parallel_state.get_tensor_model_parallel_group())
    return int(box.item())
