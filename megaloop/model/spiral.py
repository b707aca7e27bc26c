"""SpiralFormer multi-resolution recursion ("SpiralFormer" (arXiv 2602.11698)) and its state
topologies (Anchor, MeSH).

Layout ``P + K x {r_0, ..., r_{T-1}} + C``: loop step t runs the shared core on a sequence
compressed by the resolution r_t = 1 / g_t (``--loop-resolutions``). One step, for token states
h [L, b, d] (megatron layout, sequence first):

    z      = down(h)        [L_t, b, d]   chunks of g_t tokens, offset omega_t,
                                          L_t = floor((L + omega_t) / g_t)
    z_hat  = core(z)        [L_t, b, d]   the same K layers as every other step
    u      = up(z_hat)      [L, b, d]     gain lambda_t = sqrt(g_t)
    u~     = shift(u, s_t)  [L, b, d]     u~[i] = u[i - s_t], zero for i < s_t
    h_next = topology(u~)                  plain | anchor (u~ + h_0) | mesh (buffer write/read)

Chunk map (SpiralFormer Eq. 12): token i belongs to chunk pi(i) = floor((i + omega) / g) at slot
rho(i) = i + omega - g pi(i). We realise it by padding omega zeros in front of the sequence and
cutting the padded sequence into L_t whole chunks; tokens after the last whole chunk (the
incomplete chunk) are dropped and receive no update. The first chunk then holds g - omega real
tokens; mean pooling divides by g as the paper's formula does (the padding counts as zeros),
self-aggregation takes its softmax over the real tokens only.

Operators (per step, own parameters; a full-resolution step g = 1 has none and is the identity):

- down ``mean``: z_j = (1/g) sum_{i in chunk j} h_i;
  ``self-aggregation``: z_j = sum_i alpha_ji h_i, alpha_j = softmax over the chunk of A_t(h_i),
  A_t a linear scorer d -> 1 (initialised to 0: it starts as an average over the chunk);
- up ``broadcast``: u_i = (lambda/g) z_hat_pi(i);
  ``allocation``: u_i = lambda beta_{pi(i), rho(i)} z_hat_pi(i), beta_j = softmax(B_t(z_hat_j))
  over the g slots, B_t a linear d -> g (initialised to 0: it starts as the broadcast).
- shift ``overlap`` s_t = g_t - 1 (the smallest causal shift, SpiralFormer Proposition 1) or
  ``parallel``
  s_t = g_t (no overlap: a chunk only reads earlier chunks). Full-resolution steps are never
  shifted (they are on the decoding critical path, SpiralFormer App. D).

Decisions that SpiralFormer leaves open, made here:

- **RoPE of latents**: latent j gets position j, its index in the compressed sequence (the core
  sees an ordinary sequence of length L_t; the rotary table is the full one cut to L_t). Distances
  between latents are measured in chunks, so one rotary wavelength covers g_t times more tokens at
  a coarse step, which matches the chunk-level receptive field the step is meant to have.
- **Attention mask**: the core keeps its causal mask, applied to the latents (latent j attends to
  latents <= j). Latent j summarises tokens up to the last token of chunk j; the shift s_t >=
  g_t - 1 moves its update to tokens at or after that last token, so token causality holds for any
  operator pair (tests/test_spiral.py checks it by gradient, and that s_t = g_t - 2 breaks it).
  An explicit (non-causal-default) attention mask is only valid at full resolution and is dropped
  at coarse steps; megaloop's training path passes none.
- **Sequence parallelism**: refused with a coarse step. A chunk may straddle two SP shards and the
  latents L_t would need their own split; doing it right means gathering the sequence around every
  coarse step, which erases what SP saves. ``--sequence-parallel`` with a schedule of all 1s works.
- **Pipeline parallelism**: a step is split where the core is split. The stage that starts a
  loop step (the first) injects, records the state entering the step and down-scales; every stage
  runs its core layers on the L_t latents; the stage that ends it (the last) up-scales, shifts and
  applies the topology (the ``before_core`` / ``around_core`` / ``after_core`` hooks of the
  recurrence; the single-stage model runs the three on one stage). megatron-core's schedule
  sends one p2p shape, so latents cross stages padded with zeros at the end to length L, and
  each later stage cuts them back to L_t before its layers (the pad never enters a layer).
  Anchor's h_0, MeSH's B slots and the state entering the step (read by the step's MeSH routers
  on the last stage) are carry slots this module declares (megaloop/model/carry.py): they travel
  with the activation as extra [L, b, d] blocks. Each parameter has one owner: scorers and the
  transitional MeSH routers on the first stage; allocators, the step routers and the final read
  on the last.
- **Cached decoding**: each coarse step keeps its own cache entry in the KV cache
  (``LatentCache``: the K/V of its latents at their own positions, the outputs of its complete
  chunks, the tokens of the chunk being filled); its core pass reads and writes that entry's
  inference context instead of the token-level one.

Topologies (SpiralFormer section 2.1; MeSH from arXiv 2510.07739):

- ``plain``: h_next = u~ (the loop megaloop always had; only full resolution is allowed, since a
  coarse step's u~ is zero on the first s_t tokens);
- ``anchor``: h_next = u~ + h_0, h_0 the loop input (prelude output);
- ``mesh``: B slots m_b [L, b, d], m_0 = h_0, others 0. Before the loop a transitional write-read
  with routers of its own reads h_0: m_b += h_0 w_b, h^(0) = sum_b m_b r_b. Step t computes
  w = softmax(Write_t(h^(t))), r = softmax(Read_t(h^(t))) from the state entering the step, writes
  the shifted update m_b += u~ w_b and reads h^(t+1) = sum_b m_b r_b. After the last step a final
  read with its own router (fed by h^(T)) gives the state the coda and head see. Routers are
  d -> B linears, replicated on TP ranks like the exit gate. B defaults to T + 3 (as MeSH).

All parameters here are replicated over tensor-parallel ranks (the hidden state is whole on every
rank without SP, and every rank computes the same gradient), as the exit gate and injections are.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule

from megaloop.model.carry import Slot
from megaloop.model.recurrence import LoopVariant
from megaloop.model.spiral_schedule import chunk_sizes, is_active, offset, shift


# --- the operators (functional, sequence-first [s, b, ...]) ---------------------------------
def num_chunks(length: int, g: int, omega: int = 0) -> int:
    """L_t = floor((L + omega) / g): the whole chunks of the sequence with its omega pads in
    front (the last incomplete chunk is dropped). Counting the pads matters: floor(L / g) would
    also drop a chunk whose tokens have all arrived when L mod g >= g - omega, and then a token's
    output would depend on whether more tokens follow it (not prefix-consistent, so not
    decodable incrementally)."""
    return (length + omega) // g


def _chunked(x: torch.Tensor, g: int, omega: int, fill: float = 0.0) -> torch.Tensor:
    """[L, ...] -> [L_t, g, ...]: omega fill values in front, then L_t whole chunks."""
    L_t = num_chunks(x.size(0), g, omega)
    pad = x.new_full((omega,) + tuple(x.shape[1:]), fill)
    return torch.cat([pad, x])[: L_t * g].reshape((L_t, g) + tuple(x.shape[1:]))


def downscale(h: torch.Tensor, g: int, omega: int, scores: Optional[torch.Tensor] = None):
    """Token states [L, b, d] -> chunk latents [L_t, b, d]: mean pooling (scores None) or
    self-aggregation with per-token scores [L, b] (softmax within each chunk)."""
    chunks = _chunked(h, g, omega)                                   # [L_t, g, b, d]
    if scores is None:
        return chunks.sum(1) / g
    alpha = _softmax(_chunked(scores, g, omega, float("-inf")), 1).to(h.dtype)  # [L_t, g, b]
    return (alpha.unsqueeze(-1) * chunks).sum(1)


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax in at least fp32 (bf16 logits are promoted)."""
    return torch.softmax(x, dim=dim, dtype=torch.promote_types(x.dtype, torch.float32))


def upscale(z_hat: torch.Tensor, g: int, omega: int, length: int,
            alloc_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Chunk outputs [L_t, b, d] -> token updates [L, b, d], gain sqrt(g): uniform broadcast
    (alloc_logits None) or output-dependent allocation (logits [L_t, b, g], softmax over g)."""
    L_t = z_hat.size(0)
    gain = math.sqrt(g)
    if alloc_logits is None:
        u = (gain / g) * z_hat.unsqueeze(1).expand(L_t, g, *z_hat.shape[1:])
    else:
        beta = _softmax(alloc_logits, -1).to(z_hat.dtype)  # [L_t, b, g]
        u = gain * beta.permute(0, 2, 1).unsqueeze(-1) * z_hat.unsqueeze(1)  # [L_t, g, b, d]
    u = u.reshape((L_t * g,) + tuple(z_hat.shape[1:]))[omega:]     # padded index -> token index
    tail = u.new_zeros((length - u.size(0),) + tuple(u.shape[1:]))  # the dropped chunk's tokens
    return torch.cat([u, tail])


def shift_right(u: torch.Tensor, s: int) -> torch.Tensor:
    """u~[i] = u[i - s] for i >= s, 0 before (SpiralFormer Eq. 22)."""
    if s == 0:
        return u
    s = min(s, u.size(0))
    return torch.cat([u.new_zeros((s,) + tuple(u.shape[1:])), u[: u.size(0) - s]])


# --- modules --------------------------------------------------------------------------------
def _replicated_linear(config, d_in: int, d_out: int, generator=None) -> torch.nn.Linear:
    """A TP-replicated linear: zero (generator None) or normal(std) from a private generator."""
    lin = torch.nn.Linear(d_in, d_out, dtype=config.params_dtype)
    with torch.no_grad():
        if generator is None:
            lin.weight.zero_()
        else:
            w = torch.empty(d_out, d_in).normal_(0.0, config.init_method_std, generator=generator)
            lin.weight.copy_(w)
        lin.bias.zero_()
    for p in lin.parameters():
        p.sequence_parallel = config.sequence_parallel
    return lin


class _OnAnotherStage(torch.nn.Module):
    """Stands in for a router another pipeline stage owns (no parameters; never called)."""

    def forward(self, *_):
        raise RuntimeError("this MeSH router lives on another pipeline stage")


class ResolutionStep(MegatronModule):
    """One loop step's down/up operators at chunk size g (no parameters at g = 1). Under pipeline
    parallelism the scorer lives on the first stage (``down``), the allocator on the last
    (``up``): each parameter has exactly one owner."""

    def __init__(self, config, g: int, omega: int, s: int, down: str, up: str,
                 first: bool = True, last: bool = True):
        super().__init__(config=config)
        self.g, self.omega, self.s = g, omega, s
        self.first, self.last = first, last
        d = config.hidden_size
        self.scorer = _replicated_linear(config, d, 1) \
            if g > 1 and down == "self-aggregation" and first else None
        self.allocator = _replicated_linear(config, d, g) \
            if g > 1 and up == "allocation" and last else None

    def down(self, h, omega: Optional[int] = None):
        """Token states [L, b, d] -> latents [L_t, b, d] (h itself at g = 1). ``omega``: the
        pads in front, if not the step's offset (one chunk alone: g minus its token count)."""
        assert self.first, "down-scaling runs on the first pipeline stage"
        if self.g == 1:
            return h
        scores = None if self.scorer is None else self.scorer(h).squeeze(-1)
        return downscale(h, self.g, self.omega if omega is None else omega, scores)

    def up_one(self, z_hat: torch.Tensor, position: int, like: torch.Tensor) -> torch.Tensor:
        """u~ [1, b, d] of the token at ``position`` from the cached chunk outputs z_hat
        [n, b, d]: u~[i] = u[i - s], the slot rho(p) of chunk pi(p) for p = i - s (a complete
        chunk, since s >= g - 1), zero before the sequence."""
        p = position - self.s
        if p < 0:
            return torch.zeros_like(like)
        j = (p + self.omega) // self.g
        rho = p + self.omega - self.g * j
        z = z_hat[j]  # [b, d]
        gain = math.sqrt(self.g)
        if self.allocator is None:
            return (gain / self.g * z).unsqueeze(0)
        beta = _softmax(self.allocator(z), -1).to(z.dtype)  # [b, g]
        return (gain * beta[:, rho:rho + 1] * z).unsqueeze(0)

    def up(self, z_hat, length: int):
        """Core outputs [L_t, b, d] -> the shifted update u~ [L, b, d]."""
        assert self.last, "up-scaling runs on the last pipeline stage"
        if self.g == 1:
            return z_hat
        logits = None if self.allocator is None else self.allocator(z_hat)
        u = upscale(z_hat, self.g, self.omega, length, logits)
        return shift_right(u, self.s)


class MeSH(MegatronModule):
    """Memory-as-state-highways: B slots, a write and a read router per step (own parameters),
    a transitional write-read before the loop and a final read after it."""

    def __init__(self, config, num_loops: int, slots: int, generator,
                 first: bool = True, last: bool = True):
        super().__init__(config=config)
        d, self.B, self.T = config.hidden_size, slots, num_loops
        # index 0: transitional (t = -1); 1..T: loop steps; the final read is separate.
        self.write = torch.nn.ModuleList(
            [_replicated_linear(config, d, slots, generator) for _ in range(num_loops + 1)])
        self.read = torch.nn.ModuleList(
            [_replicated_linear(config, d, slots, generator) for _ in range(num_loops + 1)])
        self.final_read = _replicated_linear(config, d, slots, generator)
        # Pipeline ownership (all drawn first, so the kept weights do not depend on the split):
        # the transitional write-read runs on the first stage, the step routers and the final
        # read where each step's state is formed, on the last.
        if not first:
            self.write[0], self.read[0] = _OnAnotherStage(), _OnAnotherStage()
        if not last:
            for t in range(1, num_loops + 1):
                self.write[t], self.read[t] = _OnAnotherStage(), _OnAnotherStage()
            self.final_read = _OnAnotherStage()

    @staticmethod
    def _weights(router, h):
        return _softmax(router(h), -1).to(h.dtype)  # [L, b, B]

    @staticmethod
    def _read(memory, r):
        return sum(m * r[..., b:b + 1] for b, m in enumerate(memory))

    def begin(self, x):
        """m_0 = x, others 0; transitional write of x and read: (h^(0), memory)."""
        w, r = self._weights(self.write[0], x), self._weights(self.read[0], x)
        memory = [x] + [torch.zeros_like(x) for _ in range(self.B - 1)]
        memory = [m + x * w[..., b:b + 1] for b, m in enumerate(memory)]
        return self._read(memory, r), memory

    def step(self, u_tilde, h, memory, t: int):
        """Step t (1-based): routers read h^(t); write u~, read h^(t+1)."""
        w, r = self._weights(self.write[t], h), self._weights(self.read[t], h)
        memory = [m + u_tilde * w[..., b:b + 1] for b, m in enumerate(memory)]
        return self._read(memory, r), memory

    def finish(self, h, memory):
        """The final read, routed by h^(T)."""
        return self._read(memory, self._weights(self.final_read, h))


class SpiralLoop(MegatronModule, LoopVariant):
    """Per-step resolution operators and the state topology of a LoopedGPTModel.

    A step is ``before_core`` (first stage: down) -> ``around_core`` (every stage, its core layers
    at the step's resolution) -> ``after_core`` (last stage: up, shift, topology), the hooks of
    the recurrence (megaloop/model/recurrence.py)."""

    def __init__(self, config, loop, seed: int, first: bool = True, last: bool = True):
        super().__init__(config=config)
        self.first = first
        self.sizes = chunk_sizes(loop)
        self.topology = loop.loop_topology
        self.steps = torch.nn.ModuleList([
            ResolutionStep(config, g, offset(g, loop.resolution_offset),
                           shift(g, loop.resolution_shift), loop.resolution_down,
                           loop.resolution_up, first, last) for g in self.sizes])
        gen = torch.Generator().manual_seed(seed)  # private: other weights stay as without MeSH
        self.mesh = MeSH(config, loop.num_loops, loop.mesh_slots or loop.num_loops + 3, gen,
                         first, last) if self.topology == "mesh" else None

    # --- the loop-variant hooks (megaloop.model.recurrence) ----------------------------------
    def carry_slots(self, num_loops):
        """Anchor's h_0; MeSH's B memories and the state entering the step (its routers read it
        where the step ends)."""
        if self.mesh is not None:
            return [Slot("memory", count=self.mesh.B), Slot("entering")]
        return [Slot("anchor")] if self.topology == "anchor" else []

    def latents(self, ctx, t: int) -> "LatentCache":
        """The cache entry of coarse step t under cached decoding."""
        g = self.sizes[t - 1]
        return ctx.kv.entry(("spiral", t), lambda: LatentCache(
            ctx.kv.max_batch_size, ctx.kv.max_sequence_length // g + 1))

    def begin(self, carry, ctx, embedded):
        """Before step 1: Anchor keeps h_0; MeSH does its transitional write-read."""
        if self.mesh is not None:
            carry.h, carry.memory = self.mesh.begin(carry.h)
        elif self.topology == "anchor":
            carry.anchor = carry.h

    def before_core(self, z, carry, t, ctx):
        """First stage of step t: down-scale the injected z. Cached decoding (one token at a
        time after a prefill) keeps the tokens of the chunk being filled and down-scales it when
        its last token arrives (SpiralFormer's chunk triggering); otherwise there is no latent."""
        if self.mesh is not None:
            carry.entering = carry.h
        step = self.steps[t - 1]
        if ctx.kv is None or step.g == 1:
            return step.down(z)
        cache = self.latents(ctx, t)
        if ctx.kv.offset == 0:  # prefill: the whole prompt; keep its incomplete chunk's tokens
            done = num_chunks(z.size(0), step.g, step.omega) * step.g - step.omega
            cache.tail = list(z[max(done, 0):].split(1))
            return step.down(z)
        if z.size(0) != 1:
            raise ValueError("SpiralFormer cached decoding takes one token at a time after the "
                             "prefill")
        cache.tail.append(z)
        if (ctx.kv.offset + step.omega + 1) % step.g:
            return z[:0]  # the chunk is not complete: no latent this token
        chunk, cache.tail = torch.cat(cache.tail), []
        return step.down(chunk, omega=step.g - chunk.size(0))

    def around_core(self, run, z, attention_mask, rotary_pos_emb, t, ctx):
        """The core pass at step t's resolution: latents get the rotary table cut to L_t and
        keep the core's own causal mask (an explicit token mask does not apply to them)."""
        if ctx.num_loops != len(self.steps):
            raise ValueError(f"this model has a per-step schedule of {len(self.steps)} loop steps "
                             f"(--loop-resolutions / --loop-topology); it cannot run "
                             f"{ctx.num_loops} loops")
        if self.sizes[t - 1] == 1:
            return run(z, attention_mask, rotary_pos_emb)
        if not self.first:  # latents from the stage before, zero-padded to L: cut back to L_t
            step = self.steps[t - 1]
            z = z[:num_chunks(ctx.length, step.g, step.omega)]
        if z.size(0) == 0:  # fewer tokens than one chunk (a short prompt): no latent yet
            return z
        if ctx.kv is None:
            rope = None if rotary_pos_emb is None else rotary_pos_emb[: z.size(0)]
            return run(z, None, rope)
        # Cached: the latents have their own cache at this step (latent j at position j).
        cache = self.latents(ctx, t)
        done = cache.context.sequence_len_offset
        rope = None if rotary_pos_emb is None else rotary_pos_emb[: done + z.size(0)]
        with ctx.kv.redirect("core", t, cache.context):
            out = run(z, None, rope)
        cache.context.sequence_len_offset += z.size(0)
        cache.z_hat = out if cache.z_hat is None else torch.cat([cache.z_hat, out])
        return out

    def after_core(self, out, carry, t, ctx):
        """Last stage of step t: up-scale, shift, then the topology; returns the new state h^(t)
        (after the final read at t = T for MeSH). The MeSH routers read the entering state."""
        step = self.steps[t - 1]
        if ctx.kv is None or step.g == 1 or ctx.kv.offset == 0:
            u_tilde = step.up(out, ctx.length)
        else:  # one decoded token: its update from the cached chunk outputs
            u_tilde = step.up_one(self.latents(ctx, t).z_hat, ctx.kv.offset, carry.h)
        if self.topology == "anchor":
            return u_tilde + carry.anchor
        if self.topology == "mesh":
            h_next, carry.memory = self.mesh.step(u_tilde, carry.entering, carry.memory, t)
            return self.mesh.finish(h_next, carry.memory) if t == ctx.num_loops else h_next
        return u_tilde


class LatentCache:
    """One coarse step's cache entry under cached decoding: the K/V of its chunk latents (their
    own inference context: latent j at position j), the outputs z_hat of the complete chunks
    (each later token's update reads one), and the injected states of the chunk being filled."""

    def __init__(self, max_batch_size: int, max_latents: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.context = StaticInferenceContext(max_batch_size, max_latents)
        self.z_hat = None
        self.tail: list = []

    def nbytes(self) -> int:
        """Bytes of the latents' K/V."""
        return sum(t.numel() * t.element_size()
                   for kv in self.context.key_value_memory_dict.values() for t in kv)


def build_spiral(config, loop, first: bool = True, last: bool = True) -> Optional[SpiralLoop]:
    """``first`` / ``last``: whether this pipeline stage starts / ends each loop step."""
    return SpiralLoop(config, loop, seed=torch.initial_seed() + 2, first=first, last=last) \
        if is_active(loop) else None
