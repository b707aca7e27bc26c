"""Huginn folders (``RavenForCausalLM``, ``model_type: huginn_raven``) in and out.

Huginn-0125 ("Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth Approach") is
megaloop's looped model with these settings, each a megaloop flag:

- the token embedding times sqrt(n_embd) (``--embedding-scale``) enters a prelude of
  ``n_layers_in_prelude`` layers; its output e is kept for the loop;
- the loop starts from noise, s_0 = TruncatedNormal(0, sigma^2, +-3 sigma) x sqrt(n_embd) with
  sigma = sqrt(2 / (5 n_embd)) (``--state-init noise``); every step is
  s <- core(adapter([s; e])), the adapter a [d, 2d] matrix (``--input-injection concat-linear
  --injection-source prelude``), the core ``n_layers_in_recurrent_block`` layers;
- every layer is a sandwich, x = n2(x + attn(n1(x))), x = n4(x + mlp(n3(x))) (``--norm-scheme
  sandwich``), RMSNorm eps ``norm_eps``; attention is multi-head with one fused [q; k; v]
  matrix, a learned bias on q and k before RoPE (``--qk-bias``) and RoPE on interleaved pairs
  of dimensions, base ``rope_base`` (``--rotary-interleaved``); the MLP is SwiGLU with one
  fused [gate; up] matrix; no linear has a bias;
- the readout is ln_f(s), the coda's ``n_layers_in_coda`` layers, then ln_f again, the same
  norm (``--step-norm-placement readout --share-final-norm``), and the head tied to the
  embedding; no exit gate (``--exit-loss last``);
- training draws the loop count per step, 1 + Poisson(lambda), log lambda ~ N(log(mean) -
  sigma^2 / 2, sigma^2), sigma = 0.5, mean ``mean_recurrence`` (``--random-depth-mean``), and
  backpropagates through the last ``mean_backprop_depth`` steps only
  (``--backprop-last-steps``); inference runs ``mean_recurrence`` steps (``--num-loops``).

Every key of config.json has a role, as for the other families: HONOURED (becomes a megaloop
setting), CHECKED (megaloop computes one value; another is refused by name), DERIVED (computed
by Huginn's configuration class from other keys; checked equal to what they give) or INERT (does
not change the logits). Any other key is refused.

Tensors: ``transformer.wte``, ``transformer.{prelude,core_block,coda}.{i}.{norm_1..norm_4,
attn.Wqkv, attn.qk_bias, attn.proj, mlp.fc, mlp.proj}``, ``transformer.adapter``,
``transformer.ln_f``, the tied ``lm_head`` (absent, or equal to the embedding) and the RoPE
table ``freqs_cis`` Huginn saves with its weights (checked against the table its definition
gives, and written so on export).
"""

from __future__ import annotations

import math

import torch

from megaloop.convert.hf_families import check_roles
from megaloop.convert.layout import Heads
from megaloop.convert.tensor_readers import check_named_shapes
from megaloop.model.config import LoopConfig, ModelConfig

ARCHITECTURE, MODEL_TYPE = "RavenForCausalLM", "huginn_raven"
# Where Huginn's own modeling code lives: an export's auto_map names it (trust_remote_code).
HUB_CODE = "tomg-group-umd/huginn-0125"
RANDOM_DEPTH_SIGMA = 0.5  # Huginn's sampler (randomized_iteration_sampler)

HONOURED = {
    "architectures": "RavenForCausalLM",
    "model_type": "huginn_raven (checked against the architecture)",
    "vocab_size": "the embedding table's rows",
    "n_embd": "--hidden-size (and --embedding-scale sqrt(n_embd))",
    "n_heads": "--num-attention-heads",
    "num_key_value_heads": "--num-query-groups",
    "intermediate_size": "--ffn-hidden-size",
    "n_layers_in_prelude": "--num-prelude-layers",
    "n_layers_in_recurrent_block": "the looped core's layers",
    "n_layers_in_coda": "--num-coda-layers",
    "mean_recurrence": "--num-loops (inference) and --random-depth-mean (training)",
    "mean_backprop_depth": "--backprop-last-steps",
    "block_size": "--max-position-embeddings",
    "norm_eps": "--norm-epsilon",
    "rope_base": "--rotary-base",
    "qk_bias": "--qk-bias",
    "tie_embeddings": "tied head (Huginn's released model ties it)",
    "tie_word_embeddings": "tied head (transformers' name of tie_embeddings)",
}
CHECKED = {
    "bias": ((False,), "linear biases are not part of Huginn's released model"),
    "architecture_class_name": (("RecurrentGPT",), "only the recurrent-depth model is supported"),
    "block_class_name": (("SandwichBlock",), "only sandwich blocks are supported"),
    "norm_class_name": (("RMSNorm_llama",), "only RMSNorm is supported"),
    "mlp_class_name": (("GatedMLP",), "only the gated (SwiGLU) MLP is supported"),
    "nonlin_name": (("SiLU",), "only SiLU gating is supported"),
    "state_init": (("like-init",), "only the truncated-normal initial state is supported"),
    "injection_type": (("linear",), "only the linear adapter on [state; embedding] is supported"),
    "sampling_scheme": (("poisson-lognormal-filling",),
                        "only the Poisson-lognormal depth sampler is supported"),
    "test_time_noise": ((0, 0.0, None), "noise injected into the state at inference is not "
                                        "supported"),
}
# Keys Huginn's configuration class derives from others (its to_dict writes them).
DERIVED = ("num_attention_heads", "head_dim", "padded_vocab_size", "n_layers",
           "effective_expected_depth", "init_values")
INERT = {
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "storage dtype: megaloop reads fp32, training chooses --bf16",
    "dtype": "storage dtype: megaloop reads fp32, training chooses --bf16",
    "auto_map": "where the folder's own modeling code is; megaloop computes the model itself",
    "_name_or_path": "where the folder came from",
    "name": "the model's name",
    "hf_config": "where the model is published",
    "bos_token_id": "a tokenizer setting (the folder's tokenizer is carried along)",
    "eos_token_id": "a tokenizer / generation setting (megaloop stops at the tokenizer's "
                    "end-of-text token)",
    "pad_token_id": "a tokenizer setting",
    "use_cache": "a generation setting",
    "init_strategy": "how fresh weights are drawn; an import reads them",
    "init_orthogonal": "how fresh weights are drawn; an import reads them",
    "padding_multiple": "how the vocabulary was padded for training; vocab_size is the table",
    "activation_checkpoint_impl": "recomputation in training, not the computation",
    "test_time_noise_type": "read only with test_time_noise > 0 (refused)",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "_attn_implementation_autoset": "which attention kernel transformers picked, not what it "
                                    "computes",
}
REQUIRED = ("vocab_size", "n_embd", "n_heads", "intermediate_size", "n_layers_in_prelude",
            "n_layers_in_recurrent_block", "n_layers_in_coda", "mean_recurrence")


def is_huginn(cfg: dict) -> bool:
    arch = (cfg.get("architectures") or ["?"])[0]
    return arch == ARCHITECTURE or cfg.get("model_type") == MODEL_TYPE


def _derived(cfg: dict) -> dict:
    """What Huginn's configuration class computes from the honoured keys."""
    d, heads = cfg["n_embd"], cfg["n_heads"]
    prelude, core, coda = (cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"],
                           cfg["n_layers_in_coda"])
    depth = prelude + coda + core * cfg["mean_recurrence"]
    std = math.sqrt(2 / (5 * d))
    return {"num_attention_heads": heads, "head_dim": d // heads,
            "padded_vocab_size": cfg["vocab_size"], "n_layers": prelude + core + coda,
            "effective_expected_depth": depth,
            "init_values": {"std": std, "out_proj": std / math.sqrt(2 * depth),
                            "embedding": std, "embed_scale": math.sqrt(d)}}


def check_fields(cfg: dict) -> None:
    """Every key of a Huginn config.json accounted for; ValueError naming the first key that is
    refused, unknown, missing or inconsistent."""
    archs = cfg.get("architectures") or ["?"]
    if archs != [ARCHITECTURE] or cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json (architectures {cfg.get('architectures')}, model_type "
                         f"{cfg.get('model_type')!r}): a Huginn folder has architectures "
                         f"[{ARCHITECTURE!r}] and model_type {MODEL_TYPE!r}")
    check_roles(cfg, ARCHITECTURE, lambda k: k in HONOURED or k in CHECKED or k in INERT or
                k in DERIVED, CHECKED)
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    if cfg["n_embd"] % cfg["n_heads"]:
        raise ValueError(f"config.json n_embd {cfg['n_embd']} is not divisible by n_heads "
                         f"{cfg['n_heads']}")
    for key, want in _derived(cfg).items():
        if key not in cfg:
            continue
        got = cfg[key]
        same = all(math.isclose(got.get(k, math.nan), v, rel_tol=1e-9) for k, v in want.items()) \
            if isinstance(want, dict) and isinstance(got, dict) else got == want
        if not same:
            raise ValueError(f"config.json {key}={got!r}: Huginn's configuration derives {want!r} "
                             f"from the other keys; the file is inconsistent")
    if cfg.get("tie_embeddings", True) is not True or \
            cfg.get("tie_word_embeddings", True) is not True:
        raise ValueError("config.json tie_embeddings false: Huginn's code ties the head to the "
                         "embedding (an untied head is not supported)")


def configs(cfg: dict) -> tuple[ModelConfig, LoopConfig]:
    """(ModelConfig, LoopConfig) of a Huginn config.json, after ``check_fields``; absent keys
    take the defaults of Huginn's configuration class."""
    check_fields(cfg)
    d, heads = cfg["n_embd"], cfg["n_heads"]
    prelude, core, coda = (cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"],
                           cfg["n_layers_in_coda"])
    std = math.sqrt(2 / (5 * d))
    model = ModelConfig(
        num_layers=prelude + core + coda, hidden_size=d, ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads, num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=d // heads, max_position_embeddings=cfg.get("block_size", 4096),
        position_embedding_type="rope", rotary_base=int(cfg.get("rope_base", 50000)),
        rotary_interleaved=True, qk_bias=bool(cfg.get("qk_bias", True)),
        embedding_scale=math.sqrt(d), normalization="RMSNorm",
        norm_epsilon=cfg.get("norm_eps", 1e-6), swiglu=True, disable_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=std,
        norm_scheme="sandwich", make_vocab_size_divisible_by=1)
    mean = cfg["mean_recurrence"]
    loop = LoopConfig(
        num_loops=mean, num_prelude_layers=prelude, num_coda_layers=coda,
        step_norm_placement="readout", share_final_norm=True, exit_loss="last",
        input_injection="concat-linear", injection_source="prelude", state_init="noise",
        random_depth_mean=float(mean), random_depth_sigma=RANDOM_DEPTH_SIGMA,
        backprop_last_steps=cfg.get("mean_backprop_depth", 8))
    model.validate()
    loop.validate(model.num_layers)
    return model, loop


def default_exit(cfg: dict) -> dict:
    """The run config's ``generation`` section: Huginn's KL criterion at its default threshold
    (its ``KLExitEvaluator``, 1e-3; Huginn's plain ``generate`` runs every step, ``--exit none``)."""
    return {"exit": "huginn-kl:0.001",
            "source": "Huginn's kl exit criterion (threshold 1e-3); --exit none runs all "
                      f"{cfg.get('mean_recurrence')} steps as Huginn's generate() does"}


BLOCKS = {"prelude": "transformer.prelude", "core": "transformer.core_block",
          "coda": "transformer.coda"}
NORMS = {"input_layernorm": "norm_1", "self_attn_bda.norm": "norm_2",
         "pre_mlp_layernorm": "norm_3", "mlp_bda.norm": "norm_4"}
SIMPLE = {"self_attention.linear_proj.weight": "attn.proj.weight",
          "mlp.linear_fc1.weight": "mlp.fc.weight", "mlp.linear_fc2.weight": "mlp.proj.weight",
          **{f"{ours}.weight": f"{theirs}.weight" for ours, theirs in NORMS.items()}}


def rope_table(head_dim: int, length: int, base: float) -> torch.Tensor:
    """The [1, length, 1, head_dim / 2, 2] (cos, sin) table Huginn keeps as ``freqs_cis``:
    angle p / base^(2i / head_dim) for position p and pair i."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


def _layer_prefixes(model: ModelConfig, loop: LoopConfig):
    """(megaloop's, Huginn's) name prefix of every layer: prelude, core, coda."""
    layers = {"prelude": loop.num_prelude_layers, "coda": loop.num_coda_layers,
              "core": loop.num_core_layers(model.num_layers)}
    for block, theirs_block in BLOCKS.items():
        for i in range(layers[block]):
            yield f"{block}.layers.{i}.", f"{theirs_block}.{i}."


def _heads(model: ModelConfig) -> Heads:
    return Heads(model.num_attention_heads, model.num_query_groups, model.kv_channels)


def from_huginn(get, names: set, model: ModelConfig, loop: LoopConfig) -> dict:
    """Huginn tensors (read with ``get(name)``; ``names``: what the files hold) -> megaloop names at
    TP = 1. Raises for a tensor nothing here reads, a tied head that differs from the
    embedding, or a RoPE table other than the definition's."""
    heads, d = _heads(model), model.kv_channels
    q_rows, kv_rows = heads.num_heads * d, heads.num_groups * d
    read = set()

    def tracked(name):
        read.add(name)
        return get(name)

    out = {"embedding.word_embeddings.weight": tracked("transformer.wte.weight"),
           "step_norm.weight": tracked("transformer.ln_f.weight"),
           "injection.weight": tracked("transformer.adapter.weight")}
    if "lm_head.weight" in names and not torch.equal(tracked("lm_head.weight"),
                                                      out["embedding.word_embeddings.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: Huginn's head is "
                         "tied to the embedding (an untied head is not supported)")
    if "freqs_cis" in names:
        table = tracked("freqs_cis").float()
        want = rope_table(d, table.shape[1], model.rotary_base)
        # The released folder stores its weights, the table too, in bfloat16 (read here as
        # float32): its rounding of values up to 1 is below 2^-8, while a table of another base
        # or head size differs by O(1) at most positions.
        atol = 1e-2
        if table.shape != want.shape or not torch.allclose(table, want, atol=atol):
            raise ValueError(f"freqs_cis is not the interleaved RoPE table of head_dim {d} and "
                             f"rope_base {model.rotary_base}; config.json and the weights differ")
    for ours, theirs in _layer_prefixes(model, loop):
        for o, t in SIMPLE.items():
            out[ours + o] = tracked(theirs + t)
        q, k, v = tracked(theirs + "attn.Wqkv.weight").split([q_rows, kv_rows, kv_rows])
        out[ours + "self_attention.linear_qkv.weight"] = heads.fuse_qkv(q, k, v)
        if model.qk_bias:
            qb, kb = tracked(theirs + "attn.qk_bias").float()  # [2, 1, H, d] -> 2 x [1, H, d]
            parts = [qb.reshape(-1, 1), kb.reshape(-1, 1), torch.zeros(kv_rows, 1)]
            out[ours + "self_attention.linear_qkv.bias"] = heads.fuse_qkv(*parts)[:, 0]
    unused = sorted(set(names) - read)
    if unused:
        raise ValueError(f"the safetensors files hold tensors config.json does not describe: "
                         f"{unused[:5]}")
    return out


def to_huginn(state: dict, model: ModelConfig, loop: LoopConfig) -> dict:
    """A megaloop state dict (TP = 1, local names) of a Huginn-style model -> Huginn's tensors
    (with ``freqs_cis``, and without the tied ``lm_head``): the inverse of ``from_huginn``."""
    heads, d = _heads(model), model.kv_channels
    out = {"transformer.wte.weight": state["embedding.word_embeddings.weight"],
           "transformer.ln_f.weight": state["step_norm.weight"],
           "transformer.adapter.weight": state["injection.weight"],
           "freqs_cis": rope_table(d, model.max_position_embeddings, model.rotary_base)}
    used = {"embedding.word_embeddings.weight", "step_norm.weight", "injection.weight"}
    for ours, theirs in _layer_prefixes(model, loop):
        for o, t in SIMPLE.items():
            out[theirs + t] = state[ours + o]
            used.add(ours + o)
        q, k, v = heads.split_qkv(state[ours + "self_attention.linear_qkv.weight"])
        out[theirs + "attn.Wqkv.weight"] = torch.cat([q, k, v])
        used.add(ours + "self_attention.linear_qkv.weight")
        bias = ours + "self_attention.linear_qkv.bias"
        if bias in state:
            used.add(bias)
            qb, kb, vb = (p[:, 0] for p in heads.split_qkv(state[bias][:, None]))
            if vb.abs().max() > 0:
                raise ValueError(f"{bias}: the value bias is not zero; Huginn's attention has "
                                 f"a bias on q and k only (train with --qk-bias)")
            shape = (1, heads.num_heads, d)
            out[theirs + "attn.qk_bias"] = torch.stack([qb.reshape(shape),
                                                        kb.reshape(shape)])
    unknown = sorted(set(state) - used)
    if unknown:
        raise ValueError(f"no Huginn name for {unknown[:5]}: Huginn's code has no such tensor")
    return out


def huginn_style(model: ModelConfig, loop: LoopConfig) -> str | None:
    """None when Huginn's code computes this model, else what it cannot compute."""
    gaps = [what for what, bad in (
        ("a prelude and a coda (Huginn has both)",
         not loop.num_prelude_layers or not loop.num_coda_layers),
        (f"--norm-scheme {model.norm_scheme} (Huginn's layers are sandwiches)",
         model.norm_scheme != "sandwich"),
        ("--normalization LayerNorm (Huginn's norms are RMSNorm)",
         model.normalization != "RMSNorm"),
        ("an MLP other than SwiGLU", not model.swiglu),
        ("linear biases (--disable-bias-linear off)", not model.disable_bias_linear),
        ("--add-qkv-bias (Huginn's bias is on q and k only: --qk-bias)", model.add_qkv_bias),
        ("--qk-layernorm", model.qk_layernorm),
        ("RoPE on halves (Huginn's is --rotary-interleaved)",
         model.position_embedding_type != "rope" or not model.rotary_interleaved),
        ("--use-rope-scaling or --rotary-percent", model.use_rope_scaling or
         model.rotary_percent != 1.0),
        (f"--embedding-scale {model.embedding_scale:g} (Huginn's is sqrt(hidden size) "
         f"{math.sqrt(model.hidden_size):g})",
         not math.isclose(model.embedding_scale, math.sqrt(model.hidden_size), rel_tol=1e-12)),
        ("an untied head", model.untie_embeddings_and_output_weights),
        ("--step-norm-placement recurrent (Huginn's state is normalized for the readout only)",
         loop.step_norm_placement != "readout"),
        ("a coda norm of its own (Huginn's is --share-final-norm)", not loop.share_final_norm),
        (f"--step-norm {loop.step_norm}", loop.step_norm != "rms"),
        ("an exit gate (train with --exit-loss last)", loop.gated),
        ("an injection other than --input-injection concat-linear --injection-source prelude",
         loop.input_injection != "concat-linear" or loop.injection_source != "prelude"),
        ("--state-init prelude (Huginn starts from noise)", loop.state_init != "noise"),
        ("history injection, timestep conditioning, stepwise LoRA or SpiralFormer steps",
         loop.history_injection != "none" or loop.timestep_conditioning != "none" or
         loop.lora_rank or loop.loop_resolutions or loop.loop_topology != "plain")) if bad]
    return "; ".join(gaps) or None


def huginn_config(model: ModelConfig, loop: LoopConfig, vocab_size: int) -> dict:
    """config.json in Huginn's keys (the inverse of ``configs`` for a Huginn-style model);
    auto_map names Huginn's code on the Hugging Face Hub."""
    cfg = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "auto_map": {"AutoConfig": f"{HUB_CODE}--raven_config_minimal.RavenConfig",
                     "AutoModelForCausalLM":
                         f"{HUB_CODE}--raven_modeling_minimal.RavenForCausalLM"},
        "vocab_size": vocab_size, "n_embd": model.hidden_size,
        "n_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
        "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "n_layers_in_prelude": loop.num_prelude_layers,
        "n_layers_in_recurrent_block": loop.num_core_layers(model.num_layers),
        "n_layers_in_coda": loop.num_coda_layers, "mean_recurrence": loop.num_loops,
        "mean_backprop_depth": loop.backprop_last_steps or loop.num_loops,
        "block_size": model.max_position_embeddings, "norm_eps": model.norm_epsilon,
        "rope_base": float(model.rotary_base), "qk_bias": model.qk_bias,
        "tie_embeddings": True, "tie_word_embeddings": True, "bias": False,
        "architecture_class_name": "RecurrentGPT", "block_class_name": "SandwichBlock",
        "norm_class_name": "RMSNorm_llama", "mlp_class_name": "GatedMLP",
        "nonlin_name": "SiLU", "state_init": "like-init", "injection_type": "linear",
        "sampling_scheme": "poisson-lognormal-filling", "test_time_noise": 0,
        "test_time_noise_type": "fixed", "padding_multiple": 1, "use_cache": True,
    }
    cfg.update(_derived(cfg))
    return cfg


def check_shapes(hf_dir: str, cfg: dict, reader):
    """``reader`` once config.json's sizes are the tensors' (the embedding, the first core
    layer's fused QKV and MLP, and the layer count of each block); ValueError naming the key
    and the tensor otherwise. Only the files' headers are read."""
    path = f"{hf_dir}/config.json"
    check_fields(cfg)
    d, heads = cfg["n_embd"], cfg["n_heads"]
    head_dim, groups = d // heads, cfg.get("num_key_value_heads") or heads
    want = {"transformer.wte.weight": ((cfg["vocab_size"], d), "vocab_size x n_embd"),
            "transformer.core_block.0.attn.Wqkv.weight": (
                ((heads + 2 * groups) * head_dim, d), "(n_heads + 2 num_key_value_heads) x "
                                                      "head_dim, n_embd"),
            "transformer.core_block.0.mlp.fc.weight": (
                (2 * cfg["intermediate_size"], d), "2 intermediate_size x n_embd")}
    blocks = {("transformer.prelude", "n_layers_in_prelude"): cfg["n_layers_in_prelude"],
              ("transformer.core_block", "n_layers_in_recurrent_block"):
                  cfg["n_layers_in_recurrent_block"],
              ("transformer.coda", "n_layers_in_coda"): cfg["n_layers_in_coda"]}
    check_named_shapes(hf_dir, path, reader, want, blocks, files="the safetensors files")
    return reader
