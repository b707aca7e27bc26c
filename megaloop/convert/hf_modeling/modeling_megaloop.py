"""A looped language model exported by megaloop, in plain torch (load with trust_remote_code=True).

    tokens -> embedding e -> prelude -> h          (RoPE: plain, or Llama 3.x scaled)
    for t = 1..T:  z = h if t == 1 else inject(h, e or prelude output)
                   h = looped stack(z; step t)        # the same layers every step
                   y = norm(h); h = y (recurrent) or h (readout)
    logits = lm_head(coda(y_T))                       # the last step's prediction, or
                                                      # each token's exit step's (Ouro's rule)

It computes exactly what megaloop's LoopedGPTModel computes (megaloop's export test compares the
logits), at any loop count: ``total_ut_steps`` in the config, or ``num_loops=`` per call.

Generation keeps a key/value cache per layer and per loop step (one ``DynamicCache`` entry each:
prelude layers first, then the coda's, then step 1's core layers, step 2's, ...), so every new
token runs all T steps over itself alone and ``generate()`` is linear in length. A cache serves
one loop count: it is refused when the call asks for more steps than it holds.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megaloop import MegaloopConfig, OuroConfig


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class Linear(nn.Module):
    """A projection (bias-free unless ``bias``), with one LoRA adapter per loop step when
    ``lora_rank`` > 0."""

    def __init__(self, in_features, out_features, lora_rank=0, lora_steps=0, lora_scale=1.0,
                 bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.lora_scale = lora_scale
        if lora_rank:
            self.lora_A = nn.Parameter(torch.zeros(lora_steps, lora_rank, in_features))
            self.lora_B = nn.Parameter(torch.zeros(lora_steps, out_features, lora_rank))
        else:
            self.lora_A = self.lora_B = None

    def forward(self, x, step=0):
        y = F.linear(x, self.weight, self.bias)
        if self.lora_A is not None:
            t = min(step, self.lora_A.shape[0] - 1)  # beyond the trained steps: the last adapter
            y = y + F.linear(F.linear(x, self.lora_A[t]), self.lora_B[t]) * self.lora_scale
        return y


def llama3_inv_freq(inv_freq, p):
    """Llama 3.x RoPE scaling: wavelengths longer than original / low_freq_factor are stretched
    by ``factor``, those shorter than original / high_freq_factor kept, a linear blend between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, lora):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.groups, self.head_dim = (config.num_attention_heads,
                                                  config.num_key_value_heads, d)
        bias = getattr(config, "qkv_bias", False)
        self.q_proj = Linear(h, self.heads * d, bias=bias, **lora)
        self.k_proj = Linear(h, self.groups * d, bias=bias, **lora)
        self.v_proj = Linear(h, self.groups * d, bias=bias, **lora)
        self.o_proj = Linear(self.heads * d, h, **lora)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, step, cache=None, index=None):
        b, s, _ = x.shape
        q = self.q_proj(x, step).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x, step).view(b, s, self.groups, self.head_dim)
        v = self.v_proj(x, step).view(b, s, self.groups, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:  # the keys and values of this layer at this step, all positions
            k, v = cache.update(k, v, index)
        repeat = self.heads // self.groups  # query head j reads key/value head j // repeat
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.o_proj(out, step)


class MLP(nn.Module):
    def __init__(self, config, lora):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, f, **lora)
        self.up_proj = Linear(h, f, **lora)
        self.down_proj = Linear(f, h, **lora)

    def forward(self, x, step):
        return self.down_proj(F.silu(self.gate_proj(x, step)) * self.up_proj(x, step), step)


class DecoderLayer(nn.Module):
    """``pre``: x + f(N(x)). ``ouro``: x + N2(f(N1(x))) -- Ouro's four norms per layer."""

    def __init__(self, config, lora):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, lora)
        self.mlp = MLP(config, lora)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.ouro = config.norm_scheme == "ouro"
        if self.ouro:
            self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
            self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(self, x, cos, sin, mask, step=0, cache=None, index=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, mask, step, cache, index)
        x = x + (self.input_layernorm_2(a) if self.ouro else a)
        m = self.mlp(self.post_attention_layernorm(x), step)
        return x + (self.post_attention_layernorm_2(m) if self.ouro else m)


class ScalarMix(nn.Module):
    """z = w * src + (1 - w) * h with w = sigmoid(logit)."""

    def __init__(self):
        super().__init__()
        self.logit = nn.Parameter(torch.zeros(1))

    def forward(self, h, src):
        w = torch.sigmoid(self.logit.float()).to(h.dtype)
        return w * src + (1 - w) * h


class MegaloopPreTrainedModel(PreTrainedModel):
    config_class = MegaloopConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, (nn.Linear, Linear)) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, Linear) and module.lora_A is not None:
                nn.init.normal_(module.lora_A, std=std)
                nn.init.zeros_(module.lora_B)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class MegaloopModel(MegaloopPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        scale = (c.lora_alpha or c.lora_rank) / c.lora_rank if c.lora_rank else 1.0
        lora = dict(lora_rank=c.lora_rank, lora_steps=c.lora_steps, lora_scale=scale)
        self.prelude = nn.ModuleList(DecoderLayer(c, {}) for _ in range(c.num_prelude_layers))
        self.layers = nn.ModuleList(DecoderLayer(c, lora) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.coda = nn.ModuleList(DecoderLayer(c, {}) for _ in range(c.num_coda_layers))
        self.coda_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.num_coda_layers else None
        self.early_exit_gate = nn.Linear(c.hidden_size, 1) if c.use_exit_gate else None
        self.input_injection = ScalarMix() if c.input_injection == "scalar-mix" else None
        self.post_init()

    def rope(self, position_ids, dtype):
        # Computed per call rather than kept in a buffer: transformers may build the model on the
        # meta device and would leave a non-persistent buffer uninitialised.
        d = self.config.head_dim
        exponent = torch.arange(0, d, 2, device=position_ids.device).float() / d
        inv_freq = 1.0 / (self.config.rope_theta ** exponent)
        scaling = getattr(self.config, "rope_parameters", None) or {}
        if scaling.get("rope_type") == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        freqs = position_ids[:, :, None].float() * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, attention_mask=None, position_ids=None, num_loops=None,
                exit_rule=None, cache=None):
        b, s = input_ids.shape
        device = input_ids.device
        c = self.config
        steps = num_loops or c.total_ut_steps
        prelude, coda, core = len(self.prelude), len(self.coda), len(self.layers)
        past = cache.get_seq_length() if cache is not None else 0
        if past and len(cache) < prelude + coda + steps * core:
            raise ValueError(f"num_loops {steps}: this cache was filled at fewer loop steps; "
                             f"start a new cache for a different loop count")
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=device)[None].expand(b, s)
        # query i (at position past + i) reads keys 0 .. past + i
        mask = torch.ones(s, past + s, dtype=torch.bool, device=device).tril(past)[None, None]
        if attention_mask is not None:  # padding: nobody attends to a padded key
            if attention_mask.shape[-1] != past + s:
                raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns: give "
                                 f"one per cached and new token ({past} + {s})")
            mask = mask & attention_mask[:, None, None, :].bool()
        e = self.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, e.dtype)
        h = e
        for i, layer in enumerate(self.prelude):
            h = layer(h, cos, sin, mask, cache=cache, index=i)
        src = e if c.injection_source == "embedding" else h
        outputs = []
        for t in range(steps):
            if t > 0 and self.input_injection is not None:
                h = self.input_injection(h, src)
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, mask, t, cache, prelude + coda + t * core + i)
            y = self.norm(h)
            h = y if c.step_norm_placement == "recurrent" else h
            outputs.append(y)
        if exit_rule is not None:
            y = select_exit_step(outputs, self.early_exit_gate, *exit_rule)
        for i, layer in enumerate(self.coda):
            y = layer(y, cos, sin, mask, cache=cache, index=prelude + i)
        return self.coda_norm(y) if self.coda_norm is not None else y


def select_exit_step(outputs, gate, step, threshold):
    """Each token's state at its exit step, as Ouro's code reads it: ``step`` (0-based) for
    every token, else the first step whose cumulative exit probability
    1 - prod_{s<=t} (1 - sigmoid(gate(y_s))) reaches ``threshold`` (the last step if none)."""
    if step is not None:
        return outputs[min(step, len(outputs) - 1)]
    chosen, survival = outputs[-1], None
    done = torch.zeros(outputs[0].shape[:-1], dtype=torch.bool, device=outputs[0].device)
    for y in outputs[:-1]:
        lam = torch.sigmoid(gate(y).float()).squeeze(-1)
        survival = 1 - lam if survival is None else survival * (1 - lam)
        stop = (1 - survival >= threshold) & ~done
        chosen = torch.where(stop[..., None], y, chosen)  # a token keeps its first stop
        done |= stop
    return chosen


class MegaloopForCausalLM(MegaloopPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = MegaloopModel(config)
        # Tied models read the embedding matrix directly rather than through HF's tying hooks,
        # whose conventions differ between transformers versions.
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def exit_rule(self, exit_at_step, exit_threshold):
        """(step, threshold) of Ouro's exit rule (its argument names; defaults: config.json's
        early_exit_step and early_exit_threshold), or None for the last step (a threshold of 1
        or more: every step runs, as megaloop reads it)."""
        c = self.config
        step = exit_at_step if exit_at_step is not None else getattr(c, "early_exit_step", None)
        threshold = exit_threshold if exit_threshold is not None else \
            getattr(c, "early_exit_threshold", None)
        if step is None and (threshold is None or threshold >= 1.0):
            return None
        if self.model.early_exit_gate is None and step is None:
            raise ValueError(f"early_exit_threshold {threshold}: this model has no exit gate")
        return step, threshold

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # generate() would size its own cache by num_hidden_layers; this model needs one entry
        # per layer and loop step, and makes its cache in forward (use_cache=True).
        return False

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                num_loops=None, exit_at_step=None, exit_threshold=None, use_cache=None,
                cache=None, past_key_values=None, **kwargs):
        # As in Ouro's code, the exit rule picks each token's step for prediction; a loss
        # (labels) is the last step's.
        rule = None if labels is not None else self.exit_rule(exit_at_step, exit_threshold)
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        hidden = self.model(input_ids, attention_mask, position_ids, num_loops, rule, cache)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        loss = None
        if labels is not None:  # next-token cross-entropy of the last step
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        # transformers 5 names the output's cache "cache", 4.x "past_key_values"
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache.get_seq_length() if cache is not None else 0
        inputs = {"input_ids": input_ids[:, past:], "attention_mask": attention_mask,
                  "use_cache": kwargs.get("use_cache"), "cache": cache}
        # this model's own generate() arguments pass through to forward
        for name in ("num_loops", "exit_at_step", "exit_threshold"):
            if kwargs.get(name) is not None:
                inputs[name] = kwargs[name]
        return inputs


CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else \
    "past_key_values"


class OuroForCausalLM(MegaloopForCausalLM):
    config_class = OuroConfig
