"""Parcae folders (``parcae_lm.save_pretrained``: config.json with ``_class_name: ParcaeConfig``
and a torch state dict ``model.pt`` or ``pytorch_model.bin``) in and out.

Parcae ("Parcae: Scaling Laws For Stable Looped Language Models") is megaloop's looped model with
these settings, each a megaloop flag (examples/recipes/parcae_from_scratch.sh):

- the token embedding (no scale) enters a prelude of ``n_layers_in_prelude`` layers whose output
  is RMS-normed once (``prelude_norm``: ``--injection-source-norm``), e;
- the state starts as noise, TruncatedNormal(0, sigma^2, +-3 sigma), sigma = sqrt(2 / (5 d))
  (``--state-init noise``); before every pass of the ``n_layers_in_recurrent_block`` core layers
  it is updated as h <- exp(-dt A) * h + dt * (B e), dt = softplus(dt_bias), A = exp(A_log)
  (``--input-injection parcae --injection-source prelude``); no norm between passes;
- each pass is read out through C h (a [d, d] matrix: ``--readout-projection``, with
  ``--step-norm identity --step-norm-placement readout``), the ``n_layers_in_coda`` coda layers,
  ln_f and the head (tied to the embedding when ``tie_embeddings``); no exit gate
  (``--exit-loss last``), ``mean_recurrence`` passes at inference;
- every layer is pre-norm, x + attn(n1(x)) then x + mlp(n2(x)), RMSNorm eps ``norm_eps``;
  attention has no biases, RoPE on interleaved pairs of base 50000 (``--rotary-interleaved``),
  and with ``qk_norm`` a parameter-free RMS norm of q and k per head (``--qk-layernorm
  --qk-layernorm-scale-free``); the MLP is relu(x)^2 / 2 (``--squared-relu``, the 1/2 folded
  into fc2 here and unfolded on export: a power of two, so both are exact);
- every other layer (counting prelude, core and coda once, the last one included) adds a
  token-indexed table to its values, gated per head by 2 sigmoid(G x[:32])
  (``--value-embeddings``);
- training draws one depth per step, 1 + Poisson(mean_recurrence - 1) (``--random-depth-mean
  mean - 1 --random-depth-sigma 0``; Parcae draws max(1, Poisson(mean)) per sequence) and
  backpropagates through the last ``mean_backprop_depth`` passes (``--backprop-last-steps``).

Every key of config.json (``dataclasses.asdict`` of Parcae's configuration, so every field of it)
has a role: HONOURED (becomes a megaloop setting), CHECKED (megaloop computes one value, or one
relation to another key: MATCHED; another is refused by name), DERIVED (computed by Parcae's
configuration from other keys; checked equal to what they give) or INERT (does not change the
logits; the reason beside it). Any other key is refused. A key a file lacks takes the default of
Parcae's configuration class (``DEFAULTS``), as Parcae's loader does, and is checked the same way.

Tensors: ``transformer.wte``, ``transformer.{prelude,core_block,coda}.{i}.{norm_1, attn.c_q,
attn.c_k, attn.c_v, attn.c_proj, attn.ve_gate, norm_2, mlp.fc, mlp.proj}``,
``transformer.adapter.{A_log, dt_bias, B}``, ``transformer.C``, ``transformer.ln_f``,
``transformer.ln_prelude``, ``value_embeds.{index}``, ``lm_head`` (tied: equal to the embedding)
and the RoPE table ``freqs_cis`` Parcae keeps as a persistent buffer (checked against its
definition, and written so on export).
"""

from __future__ import annotations

import glob
import math
import os

import torch

from megaloop.convert.hf_families import check_roles
from megaloop.convert.layout import Heads
from megaloop.convert.tensor_readers import StateDictTensors, check_named_shapes
from megaloop.model.config import LoopConfig, ModelConfig

CLASS_NAME, MODEL_CLASS = "ParcaeConfig", "Parcae"
# Parcae's loader drops rope_settings from config.json, so its code always builds RoPE of base
# 50000 (RoPESettings' default); the weights' freqs_cis must be that table.
ROPE_BASE = 50000
GATE_CHANNELS = 32  # the attention input's channels the value gate reads (Parcae's ve_gate)
WEIGHT_FILES = ("pytorch_model.bin", "model.pt")  # what Parcae's loader tries, in its order
# Initialisations whose embedding std is sqrt(2 / (5 d)) (the state's noise) with neither an
# embedding scale nor a logit scale: the others change the forward.
SCALE_FREE_INITS = ("scaled-zero", "scaled", "small", "scaled-geiping", "scaled-stuck")

HONOURED = {
    "n_embd": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_key_value_heads": "--num-query-groups (Parcae's core always has as many as its heads: "
                           "refused unless equal)",
    "intermediate_size": "--ffn-hidden-size",
    "vocab_size": "with padding_multiple, the tables' rows (padded_vocab_size)",
    "n_layers_in_prelude": "--num-prelude-layers",
    "n_layers_in_recurrent_block": "the looped core's layers",
    "n_layers_in_coda": "--num-coda-layers",
    "mean_recurrence": "--num-loops (inference) and --random-depth-mean mean - 1 (training)",
    "mean_backprop_depth": "--backprop-last-steps",
    "block_size": "--max-position-embeddings",
    "norm_eps": "--norm-epsilon",
    "qk_norm": "--qk-layernorm --qk-layernorm-scale-free",
    "prelude_norm": "--injection-source-norm",
    "tie_embeddings": "--untie-embeddings-and-output-weights when false",
}
CHECKED = {
    "_class_name": ((CLASS_NAME,), "only Parcae's looped model is read here"),
    "model_class_name": ((MODEL_CLASS,), "only Parcae's looped model is supported"),
    "injection_type": (("diagonal",), "only the diagonal injection exp(-dt A) h + dt B e is "
                                      "supported"),
    "state_init": (("like-init",), "only the truncated-normal initial state is supported"),
    "block_class_name": (("TransformerPreNormBlock",), "only pre-norm blocks are supported"),
    "norm_class_name": (("RMSNorm",), "only RMSNorm is supported"),
    "mlp_class_name": (("BaseMLP",), "only the plain (not gated) MLP is supported"),
    "nonlin_name": (("ReLU2",), "only the squared ReLU (relu(x)^2 / 2) is supported"),
    "bias": ((False,), "linear biases are not part of Parcae's published models"),
    "qk_bias": ((False,), "a q/k bias is not part of Parcae's published models"),
    "init_strategy": (SCALE_FREE_INITS, "this initialisation scales the embedding or the "
                                        "logits (or draws the state otherwise)"),
    "mup_model_scaling_factor": ((1,), "muP width scaling changes the widths and logit scale"),
    "logit_softcap": ((None,), "a logit soft cap is not supported"),
    "clip_qkv": ((None,), "clipping q, k and v is not supported"),
    "use_abacus": ((False,), "abacus position embeddings are not supported"),
    "randomize_positions_from": ((None,), "randomized positions (a longer RoPE table) are not "
                                          "supported"),
    "debias_attention": ((False,), "debiased attention is not supported"),
    "center_attention": ((False,), "centered attention is not supported"),
    "simple_ops": ((False,), "Parcae's simple-ops norms are not supported"),
    "sampling_scheme": (("poisson-truncated-full",),
                        "only the truncated Poisson depth sampler is supported"),
    "_is_recurrent_block_config": ((False,), "a recurrent block's own configuration is not a "
                                             "model"),
}
# CHECKED keys that must equal another key (Parcae's core may differ in width; megaloop's not).
MATCHED = {
    "recurrent_embedding_dimension": "n_embd",
    "recurrent_intermediation_embedding_dimension": "intermediate_size",
    "recurrent_num_attention_heads": "num_attention_heads",
}
# Keys Parcae's configuration computes from others (its asdict writes them).
DERIVED = ("padded_vocab_size",)
INERT = {
    "name": "the model's name",
    "hf_config": "where the model is published",
    "attn_impl": "which attention kernel computes the same softmax attention",
    "init_orthogonal": "how fresh weights are drawn; an import reads them",
    "skip_initialization": "whether fresh weights are drawn; an import reads them",
    "use_fused_head": "how the head and loss are fused, not what they compute",
    "activation_checkpoint_impl": "recomputation in training, not the computation",
    "strategy": "how the model is spread over devices, not what it computes",
    "lockstep_n": "whether ranks draw the same depth; megaloop draws one depth per step for all",
    "lockstep_k": "whether ranks draw the same backprop depth; megaloop draws one per step",
    "curriculum_target": "read only with a curriculum- sampling scheme (refused)",
    "recurrent_iteration_method": "per batch, sequence or token depths in training; megaloop "
                                  "draws one depth per optimizer step for every sequence",
    "rope_settings": "dropped by Parcae's loader (its RoPE base is always 50000); checked "
                     "through the weights' freqs_cis",
    "padding_multiple": "how the vocabulary was padded for training; padded_vocab_size is the "
                        "tables' rows",
}
# Parcae's configuration defaults (Config, then ParcaeConfig): what its loader takes for a key a
# config.json lacks. None for intermediate_size / num_key_value_heads / padded_vocab_size: its
# configuration computes them (4 n_embd, num_attention_heads, vocab rounded up).
DEFAULTS = {
    "name": "", "hf_config": {}, "block_size": 4096, "n_embd": 4096, "intermediate_size": None,
    "num_attention_heads": 32, "num_key_value_heads": None, "vocab_size": 50254,
    "padding_multiple": 512, "padded_vocab_size": None,
    "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": ROPE_BASE},
    "use_abacus": False, "randomize_positions_from": None,
    "block_class_name": "TransformerPreNormBlock", "norm_class_name": "LayerNorm",
    "attn_impl": "flash", "norm_eps": 1e-5, "mlp_class_name": "BaseMLP", "nonlin_name": "GELU",
    "bias": False, "qk_bias": False, "init_strategy": "scaled", "init_orthogonal": False,
    "skip_initialization": False, "mup_model_scaling_factor": 1, "use_fused_head": "pytorch",
    "debias_attention": False, "center_attention": False, "clip_qkv": None, "qk_norm": False,
    "logit_softcap": None, "activation_checkpoint_impl": "per-iteration", "simple_ops": False,
    "strategy": "single", "injection_type": "diagonal", "n_layers_in_recurrent_block": 4,
    "n_layers_in_prelude": 1, "n_layers_in_coda": 1, "state_init": "like-init",
    "recurrent_embedding_dimension": 1024, "recurrent_intermediation_embedding_dimension": 3520,
    "recurrent_num_attention_heads": None, "prelude_norm": False,
    "sampling_scheme": "poisson-truncated-full", "mean_recurrence": 32,
    "mean_backprop_depth": 8, "lockstep_n": False, "lockstep_k": False,
    "curriculum_target": "forward", "recurrent_iteration_method": "per-batch",
    "tie_embeddings": False, "model_class_name": MODEL_CLASS,
    "_is_recurrent_block_config": False,
}
INTEGERS = ("block_size", "n_embd", "intermediate_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "padding_multiple", "padded_vocab_size",
            "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
            "mean_recurrence", "mean_backprop_depth", "recurrent_embedding_dimension",
            "recurrent_intermediation_embedding_dimension", "recurrent_num_attention_heads")


def is_parcae(cfg: dict) -> bool:
    return cfg.get("_class_name") == CLASS_NAME or cfg.get("model_class_name") == MODEL_CLASS


def _role(key: str) -> bool:
    return key in HONOURED or key in CHECKED or key in MATCHED or key in DERIVED or key in INERT


def _find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - n % k


def _complete(cfg: dict) -> dict:
    """``cfg`` with every absent key at Parcae's default, and the keys its configuration
    computes when None (intermediate_size, num_key_value_heads, padded_vocab_size)."""
    c = {**DEFAULTS, **cfg}
    for key in INTEGERS:  # before any arithmetic on them
        value = c[key]
        nullable = key in ("intermediate_size", "num_key_value_heads", "padded_vocab_size",
                           "recurrent_num_attention_heads", "randomize_positions_from")
        if value is None and nullable:
            continue
        least = 0 if key in ("n_layers_in_prelude", "n_layers_in_coda") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"config.json {key}={value!r}: it must be an integer of at least "
                             f"{least}")
    if c["intermediate_size"] is None:
        c["intermediate_size"] = 4 * c["n_embd"]
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    return c


def table_rows(cfg: dict) -> int:
    """The rows of the embedding and value-embedding tables (Parcae's padded_vocab_size)."""
    c = _complete(cfg)
    return c["padded_vocab_size"] or _find_multiple(c["vocab_size"], c["padding_multiple"])


def gate_layers(P: int, K: int, C: int, mean: int, depth: int) -> list:
    """Which layers (prelude, core, coda numbered once through) Parcae's code gives a value gate:
    its attention numbers the coda after the unrolled loop (P + K x mean + i) and picks every
    other number ending at K x mean_backprop_depth - 1."""
    ids = [*range(P), *(P + i for i in range(K)), *(P + K * mean + i for i in range(C))]
    return [j for j, lid in enumerate(ids) if lid % 2 == (K * depth - 1) % 2]


def table_layers(n: int) -> list:
    """megaloop's value-embedding layers of an n-layer stack (megaloop.model.value_embedding's
    rule, which is also Parcae's for its tables: every other layer, ending at the last)."""
    from megaloop.model.value_embedding import has_value_embedding

    return [j for j in range(n) if has_value_embedding(j, n)]


def check_fields(cfg: dict) -> dict:
    """Every key of a Parcae config.json accounted for; the keys completed with Parcae's
    defaults. ValueError naming the first key that is refused, unknown or inconsistent."""
    if cfg.get("_class_name") != CLASS_NAME:
        raise ValueError(f"config.json (_class_name {cfg.get('_class_name')!r}): a Parcae folder "
                         f"has _class_name {CLASS_NAME!r}")
    unknown = sorted(k for k in cfg if not _role(k))
    if unknown:
        raise ValueError(f"config.json field(s) {unknown} are unknown to megaloop for Parcae, so "
                         f"it cannot tell whether they change the computation; if you know they "
                         f"do not, delete them from config.json")
    c = _complete(cfg)
    check_roles(c, CLASS_NAME, _role, CHECKED)
    d, heads = c["n_embd"], c["num_attention_heads"]
    for key, other in MATCHED.items():
        if c[key] is None and key == "recurrent_num_attention_heads":
            continue
        if c[key] != c[other]:
            raise ValueError(f"config.json {key}={c[key]!r}: megaloop's core has the width of "
                             f"the rest of the model ({other} {c[other]!r})")
    if d % heads:
        raise ValueError(f"config.json n_embd {d} is not divisible by num_attention_heads "
                         f"{heads}")
    if c["num_key_value_heads"] != heads:
        raise ValueError(f"config.json num_key_value_heads={c['num_key_value_heads']!r}: "
                         f"Parcae's core blocks always have num_attention_heads ({heads}) "
                         f"key/value heads, so grouped-query attention is not one model")
    if d < GATE_CHANNELS:
        raise ValueError(f"config.json n_embd={d}: the value gates read {GATE_CHANNELS} "
                         f"channels of the attention input")
    want = _find_multiple(c["vocab_size"], c["padding_multiple"])
    if c["padded_vocab_size"] is not None and c["padded_vocab_size"] != want:
        raise ValueError(f"config.json padded_vocab_size={c['padded_vocab_size']!r}: Parcae's "
                         f"configuration derives {want} from vocab_size and padding_multiple; "
                         f"the file is inconsistent")
    if c["padded_vocab_size"] is None:
        c["padded_vocab_size"] = want
    if not isinstance(c["tie_embeddings"], bool) or not isinstance(c["qk_norm"], bool) or \
            not isinstance(c["prelude_norm"], bool):
        raise ValueError("config.json tie_embeddings, qk_norm and prelude_norm must be true or "
                         "false")
    P, K, C = (c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"],
               c["n_layers_in_coda"])
    if not P or not C:
        raise ValueError(f"config.json n_layers_in_prelude {P}, n_layers_in_coda {C}: megaloop "
                         f"reads Parcae models with a prelude and a coda (the published ones)")
    gates = gate_layers(P, K, C, c["mean_recurrence"], c["mean_backprop_depth"])
    if gates != table_layers(P + K + C):
        raise ValueError(f"config.json mean_backprop_depth={c['mean_backprop_depth']}: Parcae's "
                         f"code then gives layers {gates} (prelude, core, coda numbered once) "
                         f"value gates, but its value-embedding tables are at layers "
                         f"{table_layers(P + K + C)}; megaloop's value embeddings need both at "
                         f"the same layers")
    return c


def configs(cfg: dict) -> tuple[ModelConfig, LoopConfig]:
    """(ModelConfig, LoopConfig) of a Parcae config.json, after ``check_fields``; absent keys
    take the defaults of Parcae's configuration class. The table is built with exactly
    padded_vocab_size rows (--make-vocab-size-divisible-by 1)."""
    c = check_fields(cfg)
    d, heads = c["n_embd"], c["num_attention_heads"]
    P, K, C = (c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"],
               c["n_layers_in_coda"])
    model = ModelConfig(
        num_layers=P + K + C, hidden_size=d, ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads, num_query_groups=c["num_key_value_heads"],
        kv_channels=d // heads, max_position_embeddings=c["block_size"],
        position_embedding_type="rope", rotary_base=ROPE_BASE, rotary_interleaved=True,
        normalization="RMSNorm", norm_epsilon=c["norm_eps"], squared_relu=True, swiglu=False,
        disable_bias_linear=True, qk_layernorm=c["qk_norm"],
        qk_layernorm_scale_free=c["qk_norm"], value_embeddings=True,
        untie_embeddings_and_output_weights=not c["tie_embeddings"],
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=math.sqrt(2 / (5 * d)),
        norm_scheme="pre", make_vocab_size_divisible_by=1)
    mean = c["mean_recurrence"]
    loop = LoopConfig(
        num_loops=mean, num_prelude_layers=P, num_coda_layers=C, step_norm="identity",
        step_norm_placement="readout", readout_projection=True, exit_loss="last",
        input_injection="parcae", injection_source="prelude",
        injection_source_norm=c["prelude_norm"], state_init="noise",
        # 1 + Poisson(mean - 1): Parcae's depth max(1, Poisson(mean)) has the same mean
        random_depth_mean=float(mean - 1), random_depth_sigma=0.0,
        backprop_last_steps=c["mean_backprop_depth"])
    model.validate()
    loop.validate(model.num_layers)
    return model, loop


def default_exit(cfg: dict) -> dict:
    """The run config's ``generation`` section: none (Parcae runs every step)."""
    return {"exit": None,
            "source": f"Parcae runs all {_complete(cfg)['mean_recurrence']} steps (no exit rule)"}


BLOCKS = {"prelude": "transformer.prelude", "core": "transformer.core_block",
          "coda": "transformer.coda"}
SIMPLE = {"input_layernorm.weight": "norm_1.weight",
          "self_attention.linear_proj.weight": "attn.c_proj.weight",
          "pre_mlp_layernorm.weight": "norm_2.weight", "mlp.linear_fc1.weight": "mlp.fc.weight"}
TOP = {"embedding.word_embeddings.weight": "transformer.wte.weight",
       "injection.A_log": "transformer.adapter.A_log",
       "injection.dt_bias": "transformer.adapter.dt_bias",
       "injection.B": "transformer.adapter.B", "step_norm.weight": "transformer.C.weight",
       "coda.final_layernorm.weight": "transformer.ln_f.weight"}
SOURCE_NORM = ("injection.source_norm.weight", "transformer.ln_prelude.weight")
VALUE_TABLE = "self_attention.linear_qkv.value_embedding"
VALUE_GATE = "self_attention.linear_qkv.value_gate"


def rope_table(head_dim: int, length: int, base: float) -> torch.Tensor:
    """Parcae's ``freqs_cis``, [1, length, 1, head_dim / 2, 2] (cos, sin): Huginn's form."""
    from megaloop.convert.hf_huginn import rope_table as huginn_table

    return huginn_table(head_dim, length, base)


def _layers(model: ModelConfig, loop: LoopConfig):
    """(megaloop's prefix, Parcae's prefix, the layer's number once through) of every layer."""
    sizes = {"prelude": loop.num_prelude_layers, "core": loop.num_core_layers(model.num_layers),
             "coda": loop.num_coda_layers}
    j = 0
    for block, theirs in BLOCKS.items():
        for i in range(sizes[block]):
            yield f"{block}.layers.{i}.", f"{theirs}.{i}.", j
            j += 1


def _heads(model: ModelConfig) -> Heads:
    return Heads(model.num_attention_heads, model.num_query_groups or model.num_attention_heads,
                 model.kv_channels or model.hidden_size // model.num_attention_heads)


def from_parcae(get, names: set, model: ModelConfig, loop: LoopConfig) -> dict:
    """Parcae tensors (read with ``get(name)``; ``names``: what the files hold) -> megaloop names
    at TP = 1. Raises, naming the tensor, for one nothing here reads, a value table or gate at a
    layer other than megaloop's, a tied head that differs from the embedding, or a RoPE table
    other than the definition's."""
    heads = _heads(model)
    read = set()

    def tracked(name):
        if name not in names:
            raise ValueError(f"tensor {name} is missing from the weights; config.json and the "
                             f"weights come from different models (copy the folder again)")
        read.add(name)
        return get(name)

    out = {ours: tracked(theirs) for ours, theirs in TOP.items()}
    if loop.injection_source_norm:
        out[SOURCE_NORM[0]] = tracked(SOURCE_NORM[1])
    wte = out["embedding.word_embeddings.weight"]
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = tracked("lm_head.weight")
    elif "lm_head.weight" in names and not torch.equal(tracked("lm_head.weight"), wte):
        raise ValueError("lm_head.weight differs from transformer.wte.weight, but config.json "
                         "ties them (tie_embeddings true)")
    if "freqs_cis" in names:
        table = tracked("freqs_cis").float()
        want = rope_table(heads.head_dim, model.max_position_embeddings, model.rotary_base)
        # A bfloat16 file rounds values up to 1 by less than 2^-8; a table of another base or
        # head size differs by O(1) at most positions (as for Huginn's).
        if table.shape != want.shape or not torch.allclose(table, want, atol=1e-2):
            raise ValueError(f"freqs_cis is not the interleaved RoPE table of head_dim "
                             f"{heads.head_dim}, block_size {model.max_position_embeddings} and "
                             f"base {model.rotary_base} that Parcae's code uses; config.json "
                             f"and the weights differ")
    n = model.num_layers
    tables = set(table_layers(n))
    for ours, theirs, j in _layers(model, loop):
        for o, t in SIMPLE.items():
            out[ours + o] = tracked(theirs + t)
        # Parcae's MLP is proj(relu(fc x)^2 / 2), megatron-core's fc2(relu(fc1 x)^2)
        out[ours + "mlp.linear_fc2.weight"] = 0.5 * tracked(theirs + "mlp.proj.weight")
        q, k, v = (tracked(f"{theirs}attn.c_{p}.weight") for p in "qkv")
        out[ours + "self_attention.linear_qkv.weight"] = heads.fuse_qkv(q, k, v)
        table, gate = f"value_embeds.{j}.weight", theirs + "attn.ve_gate.weight"
        for name in (table, gate):
            if (name in names) != (j in tables):
                where = "has" if name in names else "lacks"
                raise ValueError(f"tensor {name}: the weights' value embeddings are not at "
                                 f"megaloop's layers (layer {j} of {n}, prelude, core, coda "
                                 f"numbered once, {where} one; megaloop's are {sorted(tables)})")
        if j in tables:
            out[ours + VALUE_TABLE] = tracked(table)
            out[ours + VALUE_GATE] = tracked(gate)
    unused = sorted(set(names) - read)
    if unused:
        raise ValueError(f"the weights hold tensors config.json does not describe: {unused[:5]}")
    return out


def to_parcae(state: dict, model: ModelConfig, loop: LoopConfig) -> dict:
    """A megaloop state dict (TP = 1, local names) of a Parcae-style model -> Parcae's state dict
    (every tensor its model holds: the tied ``lm_head`` as the embedding, ``freqs_cis``): the
    inverse of ``from_parcae``."""
    heads = _heads(model)
    out, used = {}, set()

    def take(name):
        used.add(name)
        return state[name]

    for ours, theirs in TOP.items():
        out[theirs] = take(ours)
    if loop.injection_source_norm:
        out[SOURCE_NORM[1]] = take(SOURCE_NORM[0])
    for ours, theirs, j in _layers(model, loop):
        for o, t in SIMPLE.items():
            out[theirs + t] = take(ours + o)
        out[theirs + "mlp.proj.weight"] = 2 * take(ours + "mlp.linear_fc2.weight")
        q, k, v = heads.split_qkv(take(ours + "self_attention.linear_qkv.weight"))
        out.update({theirs + "attn.c_q.weight": q, theirs + "attn.c_k.weight": k,
                    theirs + "attn.c_v.weight": v})
        if ours + VALUE_TABLE in state:
            out[theirs + "attn.ve_gate.weight"] = take(ours + VALUE_GATE)
            out[f"value_embeds.{j}.weight"] = take(ours + VALUE_TABLE)
    out["lm_head.weight"] = take("output_layer.weight") \
        if model.untie_embeddings_and_output_weights else out["transformer.wte.weight"]
    out["freqs_cis"] = rope_table(heads.head_dim, model.max_position_embeddings,
                                  model.rotary_base)
    unknown = sorted(set(state) - used)
    if unknown:
        raise ValueError(f"no Parcae name for {unknown[:5]}: Parcae's code has no such tensor")
    return out


def parcae_style(model: ModelConfig, loop: LoopConfig) -> str | None:
    """None when Parcae's code computes this model, else what it cannot compute."""
    P, C = loop.num_prelude_layers, loop.num_coda_layers
    K = loop.num_core_layers(model.num_layers)
    mean, depth = loop.num_loops, loop.backprop_last_steps or loop.num_loops
    gates_ok = bool(P and C) and gate_layers(P, K, C, mean, depth) == table_layers(P + K + C)
    groups = model.num_query_groups or model.num_attention_heads
    kv = model.kv_channels or model.hidden_size // model.num_attention_heads
    gaps = [what for what, bad in (
        ("a prelude and a coda (megaloop reads Parcae's with both)", not P or not C),
        (f"--norm-scheme {model.norm_scheme} (Parcae's layers are pre-norm)",
         model.norm_scheme != "pre"),
        ("--normalization LayerNorm (Parcae's norms are RMSNorm)",
         model.normalization != "RMSNorm"),
        ("an MLP other than --squared-relu", not model.squared_relu or model.swiglu),
        ("linear biases (--disable-bias-linear off)", not model.disable_bias_linear),
        ("--add-qkv-bias or --qk-bias", model.add_qkv_bias or model.qk_bias),
        ("--qk-layernorm without --qk-layernorm-scale-free (Parcae's QK-norm has no scale)",
         model.qk_layernorm and not model.qk_layernorm_scale_free),
        ("no --value-embeddings (Parcae's layers have them)", not model.value_embeddings),
        ("RoPE on halves or learned positions (Parcae's is --rotary-interleaved)",
         model.position_embedding_type != "rope" or not model.rotary_interleaved),
        (f"--rotary-base {model.rotary_base} (Parcae's code builds base {ROPE_BASE})",
         model.rotary_base != ROPE_BASE),
        ("--use-rope-scaling or --rotary-percent", model.use_rope_scaling or
         model.rotary_percent != 1.0),
        (f"--embedding-scale {model.embedding_scale:g}", model.embedding_scale != 1.0),
        ("--kv-channels other than hidden size / heads, or grouped-query attention",
         kv * model.num_attention_heads != model.hidden_size
         or groups != model.num_attention_heads),
        ("no --readout-projection with --step-norm identity --step-norm-placement readout",
         not loop.readout_projection or loop.step_norm != "identity"
         or loop.step_norm_placement != "readout"),
        ("an exit gate (train with --exit-loss last)", loop.gated),
        ("an injection other than --input-injection parcae --injection-source prelude",
         loop.input_injection != "parcae" or loop.injection_source != "prelude"),
        ("--state-init prelude (Parcae starts from noise)", loop.state_init != "noise"),
        ("--backprop-last-steps that puts Parcae's value gates at other layers than its "
         "tables", bool(P and C) and not gates_ok),
        ("history injection, timestep conditioning, stepwise LoRA or SpiralFormer steps",
         loop.history_injection != "none" or loop.timestep_conditioning != "none" or
         loop.lora_rank or loop.loop_resolutions or loop.loop_topology != "plain")) if bad]
    return "; ".join(gaps) or None


def parcae_config(model: ModelConfig, loop: LoopConfig, rows: int,
                  kept: dict | None = None) -> dict:
    """config.json as Parcae's save_pretrained writes it (every field of its configuration and
    _class_name) for a Parcae-style model with ``rows`` table rows; ``kept``: the INERT keys
    and vocab_size of the folder the checkpoint was imported from (import-hf records them), so
    that a round trip writes the same file."""
    kept = dict(kept or {})
    vocab, multiple = kept.pop("vocab_size", rows), kept.get("padding_multiple", 1)
    if not isinstance(vocab, int) or not isinstance(multiple, int) or multiple < 1 or \
            _find_multiple(vocab, multiple) != rows:
        vocab, kept["padding_multiple"] = rows, 1  # (--vocab-size trimmed the table)
    P, C = loop.num_prelude_layers, loop.num_coda_layers
    K = loop.num_core_layers(model.num_layers)
    d, heads = model.hidden_size, model.num_attention_heads
    ffn = model.ffn_hidden_size or 4 * d
    cfg = dict(DEFAULTS)
    cfg.update({
        "block_size": model.max_position_embeddings, "n_embd": d, "intermediate_size": ffn,
        "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": vocab,
        "padded_vocab_size": rows, "norm_class_name": "RMSNorm", "norm_eps": model.norm_epsilon,
        "nonlin_name": "ReLU2", "init_strategy": "scaled-zero", "init_orthogonal": True,
        "qk_norm": model.qk_layernorm, "n_layers_in_recurrent_block": K,
        "n_layers_in_prelude": P, "n_layers_in_coda": C, "recurrent_embedding_dimension": d,
        "recurrent_intermediation_embedding_dimension": ffn,
        "prelude_norm": loop.injection_source_norm, "mean_recurrence": loop.num_loops,
        "mean_backprop_depth": loop.backprop_last_steps or loop.num_loops,
        "recurrent_iteration_method": "per-sequence",
        "tie_embeddings": not model.untie_embeddings_and_output_weights})
    cfg.update({k: v for k, v in kept.items() if k in INERT})
    if kept.get("init_strategy") in SCALE_FREE_INITS:
        cfg["init_strategy"] = kept["init_strategy"]
    cfg["_class_name"] = CLASS_NAME
    return cfg


def kept_keys(cfg: dict) -> dict:
    """What import-hf records of a Parcae config.json for ``parcae_config``: its INERT keys,
    vocab_size and init_strategy (one of several that compute the same model)."""
    return {k: v for k, v in cfg.items() if k in INERT or k in ("vocab_size", "init_strategy")}


# --- the weights file -----------------------------------------------------------------------
def weights_file(hf_dir: str) -> str | None:
    """The torch state dict Parcae's loader reads (pytorch_model.bin, else model.pt), or None."""
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            return os.path.join(hf_dir, name)
    return None


def load_state_dict(path: str) -> StateDictTensors:
    """A Parcae folder's torch state dict (memory-mapped), read like the safetensors files."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # (pickle, zip and mmap errors alike)
        raise ValueError(f"{path} is not a readable torch state dict ({type(exc).__name__}: "
                         f"{exc}); copy or download it again") from None
    if not isinstance(state, dict) or \
            not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ValueError(f"{path} does not hold a state dict of named tensors")
    return StateDictTensors(state, path)


def open_weights(hf_dir: str):
    """The folder's tensor reader: its *.safetensors files when it has any, else the torch state
    dict Parcae's loader reads."""
    from megaloop.convert.hf_folder import SafetensorsFolder

    if glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors")):
        return SafetensorsFolder(hf_dir)
    path = weights_file(hf_dir)
    if path is None:
        raise FileNotFoundError(f"--hf-dir {hf_dir}: no weights (Parcae's loader reads "
                                f"{' or '.join(WEIGHT_FILES)}; *.safetensors are read too)")
    return load_state_dict(path)


def check_shapes(hf_dir: str, cfg: dict, reader):
    """``reader`` once config.json's sizes are the tensors' (the embedding, the first core
    layer's q, k and MLP, and the layer count of each block); ValueError naming the key and the
    tensor otherwise. Only shapes are read."""
    path = f"{hf_dir}/config.json"
    c = check_fields(cfg)
    d, heads = c["n_embd"], c["num_attention_heads"]
    head_dim, groups = d // heads, c["num_key_value_heads"]
    want = {"transformer.wte.weight": ((c["padded_vocab_size"], d),
                                       "padded_vocab_size x n_embd"),
            "transformer.core_block.0.attn.c_q.weight": ((d, d), "n_embd x n_embd"),
            "transformer.core_block.0.attn.c_k.weight": (
                (groups * head_dim, d), "num_key_value_heads x head size, n_embd"),
            "transformer.core_block.0.mlp.fc.weight": (
                (c["intermediate_size"], d), "intermediate_size x n_embd")}
    blocks = {("transformer.prelude", "n_layers_in_prelude"): c["n_layers_in_prelude"],
              ("transformer.core_block", "n_layers_in_recurrent_block"):
                  c["n_layers_in_recurrent_block"],
              ("transformer.coda", "n_layers_in_coda"): c["n_layers_in_coda"]}
    check_named_shapes(hf_dir, path, reader, want, blocks)
    return reader
