"""Choosing every row's next token in one call, from a counter-based random stream per row.

A row's draw is a pure function of (seed, stream, counter): the uniform number behind its n-th
token is a hash of the row's seed, its stream (the row index of a ``Generator`` batch, 0 for an
engine request) and n. So a row samples the same tokens alone or in any batch, with any
batch-mates, on every tensor-parallel rank, and nothing (no generator object, no host round
trip per row) is kept between tokens. The hash is SplitMix64's finaliser, computed in int64
tensors on the logits' device; the top 53 bits make a float64 uniform, which picks a token by
inverse transform over the row's kept tokens, sorted by probability.

Per row, as in the usual order: temperature, then top-k (the k largest logits), then top-p (of
the top-k's softmax, the smallest most-likely set reaching p; its first token always stays).
Temperature 0 is greedy. A row whose logits cannot be sampled (NaN, +inf, or nothing finite
after the temperature) is reported as failed rather than raising, so that the caller can end
that row alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloop.device import device_of
from megaloop.inference.transfer import to_device


# Here, below both the engine (megaloop/inference/engine.py, whose requests carry it) and its
# synchronous face Generator (megaloop/inference/generate.py, which re-exports it under its old
# import path): defined in generate.py, it made the two modules import each other.
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


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1, _MUL2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function (int64 arithmetic wraps modulo 2**64 as uint64 would)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, streams: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[b] float64 in (0, 1): the draw of each row's (seed, stream, counter)."""
    x = _mix(_mix(_mix(seeds) + streams) + counters)
    return (_shr(x, 11).double() + 0.5) / float(1 << 53)


def probabilities(logits: torch.Tensor, temperature: list, top_k: list, top_p: list):
    """([b, V] float64 probabilities after temperature, top-k and top-p, in vocabulary order;
    [b] bool: rows that cannot be sampled). Greedy rows (temperature 0) are computed at
    temperature 1 (their caller takes the argmax)."""
    b, vocab = logits.shape
    device = device_of(logits)
    # (the settings reach the device in two non-blocking copies: megaloop/inference/transfer.py)
    k, = to_device([torch.tensor([kk if kk > 0 else vocab for kk in top_k])], device)
    temp, p = to_device([torch.tensor(temperature, dtype=torch.float64),
                         torch.tensor(top_p, dtype=torch.float64)], device, torch.float64)
    temp = temp.float()
    z = logits / torch.where(temp <= 0, torch.ones_like(temp), temp)[:, None]
    # NaN or +inf (a broken row, or logits that overflow at this temperature): not sampleable
    broken = (torch.isnan(z) | torch.isposinf(z)).any(-1)
    z = torch.nan_to_num(z, nan=float("-inf"), posinf=float("-inf"))
    ranked, order = z.sort(-1, descending=True)
    rank = torch.arange(vocab, device=device)
    ranked = ranked.masked_fill(rank[None] >= k[:, None], float("-inf"))
    probs = torch.softmax(ranked.double(), -1)
    # drop a token when the tokens before it already reach p (the first always stays)
    drop = (probs.cumsum(-1) - probs >= p[:, None]) & (rank[None] > 0)
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    broken = broken | ~torch.isfinite(ranked[:, 0]) | ~torch.isfinite(probs).all(-1)
    out = torch.zeros_like(probs).scatter(-1, order, probs)
    return torch.nan_to_num(out, nan=0.0), broken


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[b] token ids drawn by inverse transform: the first token (in vocabulary order) whose
    cumulative probability reaches u times the row's total."""
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1)
    # (rounding can put u * total past the last token with mass: take that one)
    last = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(pick, last)


def stream_uniforms(seeds: list, streams: list, counters: list, device) -> torch.Tensor:
    """``uniforms`` of Python lists (seeds of either sign) on ``device``."""
    return uniforms(*to_device([torch.tensor([_signed(s) for s in seeds]),
                                torch.tensor(streams, dtype=torch.long),
                                torch.tensor(counters, dtype=torch.long)], device))


def sample_rows(logits: torch.Tensor, temperature: list, top_k: list, top_p: list,
                seeds: list, streams: list, counters: list, logprobs: bool = False):
    """[b, V] fp32 logits and per-row settings -> ([b] token ids, [b] bool ok), on the logits'
    device. A row not ok (its logits cannot be sampled from: module docstring) has token 0.
    ``logprobs``: also [b] float64, the log-probability of each row's token under the
    distribution it was drawn from (temperature, top-k and top-p applied; 0 for a greedy row,
    whose token is certain)."""
    tokens = logits.argmax(-1)
    ok = torch.isfinite(logits).any(-1)
    if all(t <= 0 for t in temperature):  # (decided on the host: no wait for the device)
        zero = torch.zeros(tokens.shape, dtype=torch.float64, device=logits.device)
        return (tokens, ok, zero) if logprobs else (tokens, ok)
    greedy, = to_device([torch.tensor([t <= 0 for t in temperature])], device_of(logits),
                        torch.bool)
    probs, broken = probabilities(logits, temperature, top_k, top_p)
    u = stream_uniforms(seeds, streams, counters, device_of(logits))
    tokens = torch.where(greedy, tokens, draw(probs, u))
    ok = ok & (greedy | ~broken)
    tokens = torch.where(ok, tokens, torch.zeros_like(tokens))
    if not logprobs:
        return tokens, ok
    chosen = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    return tokens, ok, torch.where(greedy, torch.zeros_like(chosen), chosen)
