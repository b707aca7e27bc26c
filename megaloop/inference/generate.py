"""Token generation with a looped model: prefill, then one token at a time.

The model's own forward (the recurrence's fold, megaloop/model/recurrence.py) runs every token:
with a ``LoopKVCache`` it sees only the new positions and attends to the cached ones; without one
(``kv_policy="none"``) it recomputes the whole sequence for every new token. Both give the same
logits (tests/test_inference.py), so greedy outputs are identical.

Prompts of different lengths share a batch as in megatron-core's static engine: the common
prefix length is prefilled at once, then every row advances one position per forward; a row
still inside its prompt is fed its next prompt token (its sampled token is discarded), a row past
it is fed what it generated. A row stops at the end-of-document token or after ``max_tokens``.
Under an exit rule a prompt token always runs all T steps (it is prefill, whichever forward
feeds it) and the first generated token is read at the rule's step of the last prompt position
(megaloop/inference/early_exit.py), so a row's tokens do not depend on its batch-mates' prompt
lengths (tests/test_exit_batch.py).

Under tensor parallelism the vocab-parallel logits are gathered, and every rank samples from the
same counter-based streams (megaloop/inference/sampling.py: row i of a batch draws from stream i
of ``SamplingParams.seed``), so all ranks pick the same token without a broadcast.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megaloop.device import current_device
from megaloop.inference import early_exit
from megaloop.inference.flags import check_num_loops, check_sampling
from megaloop.inference.kv_cache import LoopKVCache
from megaloop.inference.sampling import sample_rows

@dataclass
class SamplingParams:
    """How the next token is chosen from the logits."""

    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches p (1: all)."""
    seed: int = 0
    """Seed of the rows' random streams (the same on every rank)."""


def continuation_text(tokenizer, prompt: list[int], out: list[int]) -> str:
    """The text ``out`` adds after ``prompt``: decoded with the prompt, so that a word boundary's
    space lands where the tokenizer puts it (decoding ``out`` alone drops a sentencepiece
    continuation's leading space; joining two decodings with a space adds one before
    punctuation)."""
    before = tokenizer.detokenize(prompt)
    whole = tokenizer.detokenize(list(prompt) + list(out))
    return whole[len(before):] if whole.startswith(before) else tokenizer.detokenize(out)


class Generator:
    """Generates continuations of token-id prompts with a LoopedGPTModel (TP >= 1, PP = 1)."""

    def __init__(self, model, vocab_size: int, num_loops: Optional[int] = None,
                 kv_policy: str = "full", eod: Optional[int] = None, exit_rule=None):
        check_num_loops(num_loops, spell=str)  # 0 must not silently mean the trained depth
        self.model, self.vocab_size, self.eod = model, vocab_size, eod
        self.num_loops = num_loops or model.loop.num_loops
        self.kv_policy, self.exit_rule = kv_policy, exit_rule
        self.depths: list = []  # executed loop steps of every decoded token (early exit)
        # Of the last generate(): seconds of the first (prefill) forward and of the rest, the
        # forwards after the prefill, and the KV cache's bytes.
        self.stats: dict = {}
        reason = model.loop.supports(depth=self.num_loops, exit=exit_rule, kv_policy=kv_policy)
        if reason:
            raise ValueError(reason)

    def _logits(self, ids: torch.Tensor, kv: Optional[LoopKVCache],
                reading: Optional[list] = None) -> torch.Tensor:
        """Full-vocabulary fp32 logits [b, s, V] of ``ids`` (the positions after the cache; under
        an exit rule [b, 1, V], the last position's). ``reading``: per row, whether its fed token
        is still a prompt token (an exit rule then runs it through all T steps, as a prefill)."""
        from megatron.core import tensor_parallel

        offset = kv.offset if kv is not None else 0
        pos = torch.arange(offset, offset + ids.size(1), device=ids.device).expand_as(ids)
        if self.exit_rule is None:
            logits = self.model(ids, pos, None, num_loops=self.num_loops, kv_cache=kv)
        elif ids.size(1) > 1 or kv.offset == 0 or reading is None:
            logits, _ = early_exit.prefill(self.model, ids, pos, kv, self.num_loops,
                                           rule=self.exit_rule)
        else:
            logits = self._exit_step(ids, pos, kv, reading)
        if kv is not None:
            kv.advance(ids.size(1))
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return logits[..., :self.vocab_size].float()

    def _exit_step(self, ids, pos, kv: LoopKVCache, reading: list) -> torch.Tensor:
        """One position under an exit rule: the rows still reading their prompt run all T steps
        (``early_exit.prefill``), the others decode with the rule (``early_exit.decode_step``),
        each group on its own rows of the cache, so that a row's tokens are those it would get
        alone, whatever its batch-mates' prompt lengths."""
        b, logits = ids.size(0), None
        for prompt in (True, False):
            rows = [i for i in range(b) if bool(reading[i]) == prompt]
            if not rows:
                continue
            index = torch.tensor(rows, device=ids.device)
            with kv.rows(index) if len(rows) < b else contextlib.nullcontext():
                if prompt:
                    part, _ = early_exit.prefill(self.model, ids[index], pos[index], kv,
                                                 self.num_loops, rule=self.exit_rule)
                else:
                    part, depth = early_exit.decode_step(self.model, ids[index], pos[index], kv,
                                                         self.num_loops, self.exit_rule)
                    self.depths.extend(depth.tolist())
            if logits is None:
                logits = part.new_zeros((b,) + tuple(part.shape[1:]))
            logits[index] = part
        return logits

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int,
                 params: SamplingParams = SamplingParams(),
                 on_token: Optional[Callable[[int, int], bool]] = None) -> list[list[int]]:
        """The generated ids of every prompt (without the prompt), EOD included if reached.

        ``on_token(row, token)`` is called after each token is sampled (right after its forward,
        so that a caller can stream it); True stops that row there (e.g. its text now holds a
        stop string). An exception it raises ends the whole call (e.g. the client left)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        check_sampling(params.temperature, params.top_k, params.top_p, spell=str)
        self.model.eval()
        device = current_device()
        b, lengths = len(prompts), [len(p) for p in prompts]
        total = max(lengths) + max_tokens
        seq = torch.zeros(b, total, dtype=torch.long)
        for i, p in enumerate(prompts):
            seq[i, :len(p)] = torch.tensor(p)
        seq = seq.to(device)
        kv = None if self.kv_policy == "none" else LoopKVCache(b, total, self.kv_policy)
        out = [[] for _ in range(b)]
        done = [False] * b
        pos = min(lengths)  # the first position to predict
        fed = 0  # positions already in the cache
        clock, timings = time.perf_counter(), []
        while pos < total and not all(done):
            ids = seq[:, fed:pos] if kv is not None else seq[:, :pos]
            # (a row whose fed position is inside its prompt is still reading it)
            logits = self._logits(ids, kv, [fed < n for n in lengths])[:, -1]
            timings.append(time.perf_counter() - clock)
            clock = time.perf_counter()
            fed = pos
            nxt, ok = sample_rows(logits, [params.temperature] * b, [params.top_k] * b,
                                  [params.top_p] * b, [params.seed] * b, list(range(b)),
                                  [len(o) for o in out])
            nxt, ok = torch.stack([nxt, ok.long()]).tolist()
            for i in range(b):
                if not (ok[i] or done[i] or pos < lengths[i]):
                    raise ValueError(f"cannot sample row {i}'s next token: its logits hold NaN "
                                     f"or +inf, or none is finite at temperature "
                                     f"{params.temperature:g}")
            for i in range(b):
                if done[i] or pos < lengths[i]:
                    continue  # finished, or still reading its prompt (seq holds that token)
                token = int(nxt[i])
                seq[i, pos] = token
                out[i].append(token)
                done[i] = len(out[i]) >= max_tokens or token == self.eod
                if on_token is not None and on_token(i, token):
                    done[i] = True
            pos += 1
        self.stats = {"prefill_s": timings[0], "decode_s": sum(timings[1:]),
                      "decode_forwards": len(timings) - 1,
                      "kv_bytes": kv.nbytes() if kv is not None else 0}
        return out
