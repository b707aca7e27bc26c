"""Paged KV storage for the batching engine: fixed-size blocks in one pool, gathered per step.

Why not megatron-core's ``DynamicInferenceContext`` (its paged cache): in megatron-core 0.16.1
its attention path asserts flash-attn >= 2.7.3 (GPU only), and it keys its cache by layer number
with no room for the looped model's one cache per (block, loop step slot) (the KV policies,
megaloop/inference/kv_cache.py). So the engine keeps its own allocator and pool, and hands
megatron-core the static cache (``LoopKVCache``) of its own decoding:

- ``BlockAllocator``: ``num_blocks`` blocks of ``block_size`` token slots; a request holds a list
  of them and gives them all back when it finishes (no reservation of the longest sequence);
- ``PagedKV``: per (block, slot) key and layer, K and V pools [num_blocks * block_size, groups,
  dim], made at the first write. ``view`` gathers the running rows into one ``LoopKVCache``
  whose buffers are [width, rows, groups, dim], each row laid out contiguously and left-padded
  so that every row's newest token sits in the same column; ``write_back`` scatters the new
  tokens' K/V into their blocks. Consecutive decode forwards over the same rows reuse one
  gathered view with spare columns (``next_decode``): every row grows by one token per forward,
  so the layout stays aligned and only the new column is written back.

Left padding is exact with megatron-core's static path: it stores K before RoPE and rotates the
whole cached key by column at every call (and the query by its column), and a rotary score
depends only on the difference of the two columns, which padding does not change; learned
absolute positions come from each row's ``position_ids``. The padding columns are hidden by an
attention mask (``mask``); megatron-core's local core attention applies a given mask also in
decode, Transformer Engine's does not (the engine's ``grouped`` layout then forwards rows of one
cached length, which need no mask).
"""

from __future__ import annotations

from typing import Optional

import torch

from megaloop.device import device_of
from megaloop.inference.kv_cache import LoopKVCache


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` was handed over already on the device (the engine's staged integers)."""
    return getattr(t, "_megaloop_staged", False)


class BlockAllocator:
    """A free list of ``num_blocks`` block ids."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0, 1, ...

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> Optional[list[int]]:
        """``count`` block ids, or None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class _View(LoopKVCache):
    """A LoopKVCache over gathered rows; its offset is the column of the new tokens."""

    def __init__(self, rows: int, width: int, policy: str, offset: int, layer_forward: bool):
        super().__init__(rows, width, policy, layer_forward)
        self.context.sequence_len_offset = offset
        if offset > 0:
            self.context.enable_decode_mode()

    def advance(self, tokens: int) -> None:
        raise RuntimeError("a gathered view is written back, not advanced")


class PagedKV:
    """The pools of every (block, slot) cache and layer, indexed by block id."""

    def __init__(self, allocator: BlockAllocator, policy: str, device,
                 layer_forward: bool = False):
        self.allocator, self.policy, self.device = allocator, policy, device
        self.layer_forward = layer_forward  # the views' blocks run megaloop's layer forward
        self.pools: dict = {}  # (block, slot) -> {layer: (K, V)}

    def _slots(self, rows: list[tuple[list[int], int]], start: torch.Tensor, count: int):
        """[count, b] flat pool indices of tokens start[i] .. start[i]+count-1 of each row i;
        negative token indices (a row's left padding) read slot 0."""
        size = self.allocator.block_size
        width = max(len(blocks) for blocks, _ in rows)
        table = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks, _ in rows],
                             dtype=torch.long)  # [b, blocks]
        token = start.unsqueeze(0) + torch.arange(count).unsqueeze(1)  # [count, b]
        real = token >= 0
        token = token.clamp(min=0)
        block = table.gather(1, (token // size).clamp(max=width - 1).t()).t()
        return torch.where(real, block * size + token % size, 0)

    def gather_index(self, rows: list[tuple[list[int], int]], width: int) -> torch.Tensor:
        """[width * b] host tensor: the flat pool index of every column of a view of ``rows``
        ``width`` columns wide, column-major: each row's cached tokens end at column L (the
        longest cached length), the columns after them read slot 0 (overwritten by the forward;
        padding reads slot 0 too: finite, and masked)."""
        L, b = max(length for _, length in rows), len(rows)
        index = torch.zeros(width, b, dtype=torch.long)
        if L:
            lengths = torch.tensor([length for _, length in rows], dtype=torch.long)
            index[:L] = self._slots(rows, lengths - L, L)
        return index.flatten()

    def write_index(self, rows: list[tuple[list[int], int]], new_tokens: int) -> torch.Tensor:
        """[new_tokens * b] host tensor: the pool slots of the rows' next ``new_tokens`` tokens
        (their lengths as given to ``view``), column-major as the buffers are laid out."""
        lengths = torch.tensor([length for _, length in rows], dtype=torch.long)
        return self._slots(rows, lengths, new_tokens).flatten()

    def view(self, rows: list[tuple[list[int], int]], new_tokens: int, spare: int = 0,
             index: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None):
        """(cache, mask) for a forward of ``new_tokens`` positions per row over ``rows`` ((blocks,
        cached length) each): every row's cached tokens end at column L = the longest cached
        length, the new ones fill columns L..L+new_tokens-1 (``spare`` more columns are
        allocated for ``next_decode``). ``index`` (``gather_index``) and ``lengths`` (the rows'
        cached lengths): already on the device (the engine copies a step's integers in one
        transfer); None: made here and copied."""
        L, b = max(length for _, length in rows), len(rows)
        width = L + new_tokens + spare
        if index is None:
            index = self.gather_index(rows, width).to(self.device)
        kv = _View(b, width, self.policy, L, self.layer_forward)
        for key, layers in self.pools.items():
            kv.dicts[key] = {
                n: tuple(pool.index_select(0, index).view(width, b, *pool.shape[1:])
                         for pool in (k, v)) for n, (k, v) in layers.items()}
        kv.layers = self._layers()
        return kv, self.mask(self._lengths(rows, lengths), L, new_tokens)

    def reusable(self, kv: _View, rows: list[tuple[list[int], int]]) -> bool:
        """Whether the decode forward after ``kv``'s for the same rows, each one token longer,
        can reuse ``kv``'s buffers (they hold the last forward's new column already, as written
        back): a spare column is left and the pools did not change."""
        L = max(length for _, length in rows)
        return L == kv.offset + 1 and L + 1 <= kv.max_sequence_length and \
            kv.layers == self._layers()

    def next_decode(self, kv: _View, rows: list[tuple[list[int], int]],
                    lengths: Optional[torch.Tensor] = None):
        """(cache, mask) of that next decode forward (``reusable``), or None."""
        if not self.reusable(kv, rows):
            return None
        kv.context.sequence_len_offset = max(length for _, length in rows)
        kv._first_written.clear()
        return kv, self.mask(self._lengths(rows, lengths), kv.offset, 1)

    def _lengths(self, rows, lengths: Optional[torch.Tensor]) -> torch.Tensor:
        if lengths is not None:
            return lengths
        return torch.tensor([length for _, length in rows], dtype=torch.long)

    def _layers(self) -> int:
        return sum(len(layers) for layers in self.pools.values())

    def mask(self, lengths: torch.Tensor, L: int, new_tokens: int) -> torch.Tensor:
        """[rows, 1, new, L + new] True where a query may not look: a row's left padding (its
        cached tokens end at column L) and the columns after the query. Made where ``lengths``
        is (host lengths: then copied to the device)."""
        width, b = L + new_tokens, len(lengths)
        staged = _on_device(lengths)
        where = {"device": device_of(lengths)} if staged else {}
        column = torch.arange(width, **where)
        padding = column.view(1, width) < (L - lengths).view(b, 1)
        after = column.view(1, width) > L + torch.arange(new_tokens, **where).view(new_tokens, 1)
        mask = padding.view(b, 1, 1, width) | after.view(1, 1, new_tokens, width)
        return mask if staged else mask.to(self.device)

    def static_mask(self, lengths: torch.Tensor, L: int, width: int) -> torch.Tensor:
        """[rows, 1, 1, width]: ``mask`` of a one-token forward at column L over a view's whole
        ``width`` (the columns after L hidden too), so its shape does not change while the
        view serves (megaloop/inference/cuda_graphs.py)."""
        b = len(lengths)
        where = {"device": device_of(lengths)} if _on_device(lengths) else {}
        column = torch.arange(width, **where).view(1, width)
        mask = (column < (L - lengths).view(b, 1)) | (column > L)
        mask = mask.view(b, 1, 1, width)
        return mask if where else mask.to(self.device)

    def write_back(self, kv: _View, rows: list[tuple[list[int], int]], new_tokens: int,
                   dest: Optional[torch.Tensor] = None) -> None:
        """Scatter the new columns of every cache ``kv`` holds into the rows' blocks (their
        lengths as given to ``view``; the caller counts the new tokens in). ``dest``
        (``write_index``) already on the device, or None: made here and copied."""
        L = kv.offset
        if dest is None:
            dest = self.write_index(rows, new_tokens).to(self.device)
        size = self.allocator.num_blocks * self.allocator.block_size
        for key, layers in kv.dicts.items():
            pools = self.pools.setdefault(key, {})
            for n, (k, v) in layers.items():
                if n not in pools:
                    pools[n] = tuple(torch.zeros((size,) + t.shape[2:], dtype=t.dtype,
                                                 device=t.device) for t in (k, v))
                for pool, t in zip(pools[n], (k, v)):
                    new = t[L:L + new_tokens]
                    pool.index_copy_(0, dest, new.reshape((-1,) + t.shape[2:]))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for layers in self.pools.values() for kv in layers.values() for t in kv)
