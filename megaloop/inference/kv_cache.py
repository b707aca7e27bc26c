"""A KV cache for a looped model, on megatron-core's ``StaticInferenceContext``.

megatron-core's attention finds its cache as ``context.key_value_memory_dict[layer_number]``.
A looped model calls the same core layers (the same layer numbers) at every loop step, and its
prelude, core and coda blocks each number their layers from 1, so one dict would mix them up.
``LoopKVCache`` keeps one dict per (block, slot) and swaps it into the context around each block
call (``use``); the context's offsets, allocation and slicing stay megatron-core's.

Which slot a core or coda step uses is the KV policy:

- ``full``: step t has its own slot (T slots): exactly the uncached forward;
- ``last-step``: one slot for all steps; a token's K/V end up those of its last step (memory
  1/T of ``full``);
- ``first-step``: one slot holding each token's step-1 K/V; later steps read it (and their own
  K/V for the current token) but do not keep what they wrote (a coda read out at the last step
  only keeps that step's);
- ``shared-mod-k``: step t uses slot (t - 1) mod k (Huginn's KV sharing; k = T is ``full``).

A loop variant that keeps state of its own across decoded tokens (SpiralFormer's coarse steps:
their latents' K/V, chunk outputs, the chunk being filled) keeps it as a cache *entry* under a key
of its choosing (``entry``), and may hand a block call its own inference context (``redirect``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Hashable, Optional

import torch

from megaloop.model.layer_forward import ROWS

POLICIES = ("full", "last-step", "first-step", "shared-mod-k")


def parse_policy(text: str) -> tuple[str, int]:
    """``full`` | ``last-step`` | ``first-step`` | ``shared-mod-<k>`` -> (policy, k)."""
    m = re.fullmatch(r"shared-mod-(\d+)", text)
    if m:
        if int(m.group(1)) < 1:
            raise ValueError(f"--kv-policy {text}: k must be >= 1")
        return "shared-mod-k", int(m.group(1))
    if text not in POLICIES[:3]:
        raise ValueError(f"unknown --kv-policy {text!r}; choose full, last-step, first-step, "
                         f"shared-mod-<k> (or none: no cache)")
    return text, 0


class LoopKVCache:
    """Per-(block, slot) key/value dicts around one megatron-core ``StaticInferenceContext``."""

    def __init__(self, max_batch_size: int, max_sequence_length: int, policy: str = "full",
                 layer_forward: bool = False):
        from megatron.core.inference.contexts import StaticInferenceContext

        from megaloop.model.layer_forward import MARK

        self.policy, self.k = parse_policy(policy)
        self.context = StaticInferenceContext(max_batch_size, max_sequence_length)
        # The blocks' calls under this cache run megaloop's inference forward of the same
        # layers (megaloop/model/layer_forward.py), which fills and reads these buffers as
        # megatron-core's static path does.
        setattr(self.context, MARK, layer_forward)
        self.layer_forward = layer_forward
        self.dicts: dict = {}
        self._rows = None  # the batch rows a compacted call runs on (``rows``)
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.entries: dict = {}
        self._redirects: dict = {}
        self._first_written: set = set()  # first-step: (block, offset) written at step 1

    @property
    def offset(self) -> int:
        """Tokens already in the cache (the position of the next token)."""
        return self.context.sequence_len_offset

    def advance(self, tokens: int) -> None:
        """After a forward over ``tokens`` new positions."""
        self.context.sequence_len_offset += tokens
        self._first_written.clear()
        if self.context.sequence_len_offset > 0:
            self.context.enable_decode_mode()

    def slot(self, step: int) -> int:
        if self.policy == "full":
            return step
        if self.policy == "shared-mod-k":
            return (step - 1) % self.k + 1
        return 1  # last-step, first-step: one shared slot

    @contextlib.contextmanager
    def use(self, block: str, step: Optional[int] = None, new_tokens: int = 0):
        """Swap in the dict of ``block`` ("prelude", "core", "coda") at loop step ``step``.
        ``first-step``: steps after the first keep nothing of what they write (the new
        tokens' rows are restored after the call)."""
        if (block, step) in self._redirects:
            yield self._redirects[(block, step)]
            return
        key = (block, 0 if step is None else self.slot(step))
        kv_dict = self.dicts.setdefault(key, {})
        full = None
        # (An empty dict here is a block without attention layers, e.g. no coda: the prefill of
        # an early-exit decode reads out every step, so every cache a step uses exists.)
        # megaloop's layer forward reads and writes the running rows in place (``ROWS``);
        # megatron-core's layers get a compact copy of them, written back after the call.
        setattr(self.context, ROWS, self._rows if self.layer_forward else None)
        if self._rows is not None and kv_dict and not self.layer_forward:
            # Compact only the caches this call reads: a copy of the running rows, written back.
            full = dict(kv_dict)
            kv_dict = {n: (k.index_select(1, self._rows), v.index_select(1, self._rows))
                       for n, (k, v) in full.items()}
        saved = None
        if self.policy == "first-step" and step == 1:
            self._first_written.add((block, self.offset))
        elif self.policy == "first-step" and step is not None and kv_dict and \
                (block, self.offset) in self._first_written:
            # Only a block that wrote these tokens' step-1 K/V in this forward keeps them: a
            # coda read out at step T only (no exit rule) keeps its only K/V, step T's.
            start = self.offset
            rows = slice(start, start + new_tokens)
            saved = {n: (k[rows].clone(), v[rows].clone()) for n, (k, v) in kv_dict.items()}
        self.context.key_value_memory_dict = kv_dict
        try:
            yield self.context
        finally:
            if saved is not None:
                for n, (k, v) in saved.items():
                    kv_dict[n][0][rows] = k
                    kv_dict[n][1][rows] = v
            if full is not None:
                for n, (k, v) in kv_dict.items():
                    full[n][0].index_copy_(1, self._rows, k)
                    full[n][1].index_copy_(1, self._rows, v)

    @contextlib.contextmanager
    def rows(self, rows):
        """Run the model on a subset of the batch rows (a LongTensor of row indices): each cache
        a block call uses is swapped for a compact copy of those rows and written back after the
        call. Early exit runs later loop steps on the rows still going (compacted, not masked).
        A variant's cache entries are not compacted: with any, this refuses."""
        if self.entries:
            raise ValueError(f"early exit compacts the batch, but the cache holds loop-variant "
                             f"entries ({', '.join(map(str, self.entries))}) that it cannot "
                             f"compact; decode without --exit")
        # Nested calls compose: the rows of an inner call index the outer call's rows (a
        # Generator step runs its prompt-reading and its decoding rows apart; decoding then
        # compacts its own rows as they exit).
        outer = self._rows
        self._rows = rows if outer is None else outer.index_select(0, rows)
        try:
            yield
        finally:
            self._rows = outer

    def fill_exited(self, rows, position: int, exit_step: int, num_loops: int) -> None:
        """Rows whose token left the loop at ``exit_step`` have no K/V at later steps: copy their
        exit step's K/V (core and coda) into the slots of steps exit_step+1 .. T at
        ``position``, so later tokens attend to them at every step. Inside ``rows`` the rows
        index that call's subset."""
        if self._rows is not None:
            rows = self._rows.index_select(0, torch.as_tensor(rows, device=self._rows.device))
        for block in ("core", "coda"):
            source = self.dicts.get((block, self.slot(exit_step)))
            if not source:
                continue
            for step in range(exit_step + 1, num_loops + 1):
                target = self.dicts.get((block, self.slot(step)))
                if target is None or target is source:
                    continue
                for n, (k, v) in source.items():
                    target[n][0][position, rows] = k[position, rows]
                    target[n][1][position, rows] = v[position, rows]

    def entry(self, key: Hashable, make: Callable[[], object]):
        """A loop variant's own state under ``key``, made by ``make()`` on first use and kept
        for the whole generation; it has an ``nbytes()`` method (counted in ``nbytes``)."""
        if key not in self.entries:
            self.entries[key] = make()
        return self.entries[key]

    @contextlib.contextmanager
    def redirect(self, block: str, step: Optional[int], context):
        """Within this block, calls of ``block`` at ``step`` use ``context`` (a variant's own
        inference context, e.g. latents at their own positions) instead of the token cache."""
        self._redirects[(block, step)] = context
        try:
            yield
        finally:
            del self._redirects[(block, step)]

    def nbytes(self) -> int:
        """Bytes held by every cache tensor (the variants' entries included)."""
        own = sum(t.numel() * t.element_size()
                  for d in self.dicts.values() for kv in d.values() for t in kv)
        return own + sum(entry.nbytes() for entry in self.entries.values())
