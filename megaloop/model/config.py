"""Model and loop configuration.

``ModelConfig`` holds what Megatron-LM calls the network size and architecture flags (same names,
same meanings). ``LoopConfig`` holds the few flags that are new in a looped model. Together they
produce the megatron-core ``TransformerConfig`` that every block of the model is built from.

The loop flags' help cites three papers by short name: "Closing the Loop" (arXiv 2610.00673, the
LoopLM/Ouro recipe), "SpiralFormer" (multi-resolution recursion) and "What Makes Recurrence
Effective in Looped Language Models?" (cited as "Recurrence Effective": injections, timestep
conditioning).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class ModelConfig:
    """Network size and architecture (Megatron-LM's flags)."""

    num_layers: int = 2
    """Number of distinct (physical) transformer layers: prelude + core + coda."""

    use_mcore_models: bool = False
    """Accepted for Megatron-LM command lines: megaloop's models are always megatron-core
    models."""

    hidden_size: int = 64
    """Transformer hidden size."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size. Default: 4 * hidden-size (Megatron-LM's default)."""

    num_attention_heads: int = 4
    """Number of attention heads."""

    group_query_attention: bool = False
    """Grouped-query attention (Megatron-LM's switch): the keys and values have --num-query-groups
    heads (1 when that is not given, as Megatron-LM's default)."""

    num_query_groups: Optional[int] = None
    """Number of key/value groups for grouped-query attention. megaloop applies it whenever it is
    given; Megatron-LM reads it only with --group-query-attention (a Megatron-LM script with GQA
    passes both). Default: one per head (no GQA), or 1 with --group-query-attention."""

    kv_channels: Optional[int] = None
    """Per-head projection size. Default: hidden-size / num-attention-heads."""

    max_position_embeddings: int = 64
    """Longest sequence the position embedding supports."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """Position embedding: learned absolute (Megatron-LM's default), rotary (`rope`: Llama, Qwen,
    Ouro), or none."""

    rotary_base: int = 10000
    """RoPE base (theta)."""

    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates."""

    # --- Llama 3.x RoPE scaling and Qwen2's QKV bias (Megatron-LM's flags, names and defaults).

    use_rope_scaling: bool = False
    """Llama 3.x RoPE frequency scaling (megatron-core's: wavelengths above 8192 positions are
    divided by --rope-scaling-factor, those below 2048 kept, a smooth blend between; i.e. low and
    high frequency factors 1 and 4 on an original context of 8192)."""

    rope_scaling_factor: float = 8.0
    """Factor of --use-rope-scaling (8 for Llama 3.1, 32 for Llama 3.2)."""

    add_qkv_bias: bool = False
    """A bias on the query, key and value projections only (Qwen2 / Qwen2.5); the other linears
    follow --disable-bias-linear."""

    qk_bias: bool = False
    """A learned bias per head on q and k, added before RoPE (Huginn's ``qk_bias``): megatron-core's
    QKV bias (--add-qkv-bias) with its value part held at zero (megaloop/model/qk_bias.py)."""

    rotary_interleaved: bool = False
    """RoPE rotates interleaved pairs of dimensions (2i, 2i + 1) (Huginn's, GPT-J's layout)
    instead of the two halves (Llama's)."""

    embedding_scale: float = 1.0
    """The embedding's output (the token embedding, plus the learned position embedding if any)
    is multiplied by this before the prelude (Huginn: sqrt(hidden size)); the tied head reads
    the unscaled table."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization used by every norm of the model (Megatron-LM's default LayerNorm; Llama,
    Qwen and Ouro use RMSNorm)."""

    apply_layernorm_1p: bool = False
    """LayerNorm weights stored as (gamma - 1), initialised at 0 (megatron-core's
    zero-centered gamma; Megatron-LM's flag). Needs --normalization LayerNorm."""

    norm_epsilon: float = 1e-5
    """Epsilon of every norm (Ouro uses 1e-6)."""

    swiglu: bool = False
    """Gated SiLU MLP (SwiGLU: Llama, Qwen, Ouro) instead of Megatron-LM's default GELU MLP."""

    disable_bias_linear: bool = False
    """No biases in the linear layers (Llama, Qwen, Ouro; Megatron-LM's default keeps them)."""

    qk_layernorm: bool = False
    """Normalize queries and keys per head before attention (Qwen3)."""

    qk_layernorm_scale_free: bool = False
    """With --qk-layernorm: q/k RMS norms without a learned scale whose epsilon is the machine
    epsilon of the input's dtype (torch's default), Parcae's QK-norm. Parcae normalizes after
    RoPE, megatron-core before it; over a whole head the two are the same (a rotation keeps the
    RMS), hence --rotary-percent 1."""

    value_embeddings: bool = False
    """Every other layer (ending at the last, counting prelude, core and coda once) adds a
    token-indexed table to attention's values, gated per head by 2 sigmoid(G x[:32]): Parcae's
    value embeddings (megaloop/model/value_embedding.py). Not with --sequence-parallel."""

    untie_embeddings_and_output_weights: bool = False
    """Give the LM head its own weight instead of sharing the input embedding's."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""

    hidden_dropout: float = 0.1
    """Dropout on the residual branches (Megatron-LM's default 0.1; Llama-style pretraining uses
    0)."""

    attention_dropout: float = 0.1
    """Dropout on attention probabilities (Megatron-LM's default 0.1; Llama-style pretraining
    uses 0)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this; only where the tensor-parallel size does not divide
    that, pad to a multiple of this times the TP size. (Megatron-LM always multiplies by the TP
    size; megaloop does not, so the same run at TP=1 and TP=2 has the same vocabulary rows.)"""

    transformer_impl: Literal["transformer_engine", "local", "auto"] = "transformer_engine"
    """Layer backend: Transformer Engine (Megatron-LM's default; on a GPU it must be installed),
    megatron-core's `local` modules, or `auto` (TE iff TE imports and a GPU is present). On a
    machine without a GPU the layers are always the local spec (TE's kernels need a GPU)."""

    norm_scheme: Literal["ouro", "pre", "post", "sandwich", "magic"] = "ouro"
    """Norm placement in every layer (prelude, core, coda; Closing the Loop App. A): `ouro`
    normalizes the input and the output of each sub-layer (the normalized output joins the
    residual); `pre` u + B(N(u)); `post` N(u + B(u)); `sandwich` N2(u + B(N1(u))); `magic` pre-norm
    whose norms have no learnable scale."""

    # --- Kernels. Megatron-LM's fusion switches, with its names and meanings; on a machine
    # without a GPU every fusion stays off whatever they say (megaloop.model.config.kernel_settings
    # makes the decision; RunConfig.validate refuses the combinations a looped model gets wrong).

    no_masked_softmax_fusion: bool = False
    """Disable fusion of query-key scaling, masking and softmax (the local spec's attention on a
    GPU; the kernel comes from apex, and Transformer Engine attention does not read it). The fused
    causal kernel applies the causal mask only, so with --reset-attention-mask on a GPU validation
    asks for this flag."""

    no_bias_swiglu_fusion: bool = False
    """Disable the fused bias + SwiGLU of the MLP (GPU; a GELU MLP is never fused)."""

    no_bias_dropout_fusion: bool = False
    """Disable the fused bias + dropout + residual add (GPU)."""

    no_rope_fusion: bool = False
    """Disable the fused RoPE kernel (Transformer Engine's, so GPU with the TE spec only)."""

    gradient_accumulation_fusion: bool = False
    """Fuse the weight-gradient GEMM with its accumulation into the fp32 `main_grad` (GPU; the
    local spec needs apex's fused_weight_gradient_mlp_cuda). Off by default, unlike Megatron-LM:
    a Transformer Engine linear called T times per micro-batch overwrites instead of accumulating
    (Megatron-LM PR #6965), so validation allows it only where no TE layer repeats."""

    no_gradient_accumulation_fusion: bool = False
    """Megatron-LM's flag: keep gradient-accumulation fusion off (megaloop's default already)."""

    cross_entropy_loss_fusion: bool = False
    """Fused vocab-parallel cross-entropy for the per-step LM losses (GPU)."""

    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Implementation of --cross-entropy-loss-fusion: megatron-core's `native` one or
    Transformer Engine's parallel cross-entropy `te` (needs TE)."""

    attention_backend: Literal["flash", "fused", "unfused", "local", "auto"] = "auto"
    """Attention backend (megatron-core's AttnBackend): Transformer Engine's `flash`, `fused` or
    `unfused` attention, megatron-core's `local` attention (the local spec), or `auto` (TE
    chooses; the local spec uses its own)."""

    # --- FP8 (Transformer Engine, GPU only): Megatron-LM's flags, names and defaults.

    fp8_format: Optional[Literal["e4m3", "hybrid"]] = None
    """Train the Transformer Engine linears in FP8: `e4m3` for all FP8 tensors, or `hybrid` (e4m3
    for activations and weights, e5m2 for gradients). Needs a GPU, the TE spec and --bf16. A
    core layer runs T times per micro-batch; see the README's "FP8 and the loop"."""

    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    """FP8 scaling recipe: `delayed` (scales from an amax history, updated at every block call,
    i.e. T times per micro-batch for the core), `tensorwise` (per-tensor current scaling),
    `blockwise` (block scaling) or `mxfp8` (Blackwell). For loops prefer the current-scaling
    recipes `tensorwise` / `mxfp8`."""

    fp8_margin: int = 0
    """Margin (power of two) for the FP8 scaling factor computation."""

    fp8_amax_history_len: int = 1
    """Length of the amax history window of the delayed recipe."""

    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """How the delayed recipe picks amax from its history: `most_recent` or `max`."""

    fp8_param_gather: bool = False
    """Keep the compute parameters in FP8 and all-gather them in FP8 (needs
    --use-distributed-optimizer)."""

    first_last_layers_bf16: bool = False
    """Keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers in
    BF16 under FP8 (not with the delayed recipe). megatron-core counts them per block, so megaloop
    allows it for a core-only layout (no prelude or coda): those core layers run in BF16 at every
    loop step."""

    num_layers_at_start_in_bf16: int = 1
    """Layers at the start kept in BF16 by --first-last-layers-bf16."""

    num_layers_at_end_in_bf16: int = 1
    """Layers at the end kept in BF16 by --first-last-layers-bf16."""

    squared_relu: bool = False
    """Squared-ReLU MLP, relu(x)^2 (megatron-core's ``squared_relu``; Megatron-LM's flag), instead
    of the default GELU; not with --swiglu (Parcae's MLP, whose 1/2 factor folds into fc2)."""

    def __post_init__(self):
        # Megatron-LM's --group-query-attention without --num-query-groups means one group.
        if self.group_query_attention and self.num_query_groups is None:
            self.num_query_groups = 1

    def validate(self) -> None:
        """Raise ValueError naming the flag and the fix; called before any process group starts."""
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; choose a hidden size that is a multiple of the head count")
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {groups}; use a divisor of the head count")
        if self.apply_layernorm_1p and self.normalization != "LayerNorm":
            raise ValueError(f"--apply-layernorm-1p is a LayerNorm option; drop it or use "
                             f"--normalization LayerNorm, not {self.normalization}")
        if self.num_layers < 1:
            raise ValueError(f"--num-layers {self.num_layers} must be at least 1")
        if self.qk_bias and self.add_qkv_bias:
            raise ValueError("--qk-bias is a q/k bias with the value bias held at zero; "
                             "--add-qkv-bias trains all three: pass one of them")
        if self.rotary_interleaved and self.position_embedding_type != "rope":
            raise ValueError(f"--rotary-interleaved is a RoPE layout; it needs "
                             f"--position-embedding-type rope, not {self.position_embedding_type}")
        if not self.embedding_scale > 0:
            raise ValueError(f"--embedding-scale {self.embedding_scale} must be positive "
                             f"(1.0: no scaling)")
        if self.position_embedding_type == "rope" and self.rotary_base <= 0:
            raise ValueError(f"--rotary-base {self.rotary_base} must be positive")
        if self.use_rope_scaling and self.position_embedding_type != "rope":
            raise ValueError(f"--use-rope-scaling scales rotary embeddings; it needs "
                             f"--position-embedding-type rope, not {self.position_embedding_type}")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"--rope-scaling-factor {self.rope_scaling_factor} must be positive")
        if not self.use_rope_scaling and self.rope_scaling_factor != 8.0:
            raise ValueError(f"--rope-scaling-factor {self.rope_scaling_factor} has no effect "
                             f"without --use-rope-scaling; pass both or neither")
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} {p} must be in [0, 1)")
        if self.gradient_accumulation_fusion and self.no_gradient_accumulation_fusion:
            raise ValueError("--gradient-accumulation-fusion and --no-gradient-accumulation-fusion "
                             "contradict each other; pass one of them")
        if self.fp8_margin < 0 or self.fp8_amax_history_len < 1:
            raise ValueError(f"--fp8-margin {self.fp8_margin} must be >= 0 and "
                             f"--fp8-amax-history-len {self.fp8_amax_history_len} >= 1")
        if self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0:
            raise ValueError("--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 must "
                             "be >= 0")
        if self.qk_layernorm_scale_free and not self.qk_layernorm:
            raise ValueError("--qk-layernorm-scale-free is a form of the q/k norms; pass "
                             "--qk-layernorm too")
        if self.qk_layernorm_scale_free and (self.rotary_percent != 1.0
                                             or self.normalization != "RMSNorm"):
            raise ValueError(f"--qk-layernorm-scale-free is an RMS norm over whole heads that "
                             f"commutes with RoPE: it needs --normalization RMSNorm (not "
                             f"{self.normalization}) and --rotary-percent 1.0 (not "
                             f"{self.rotary_percent})")
        if self.value_embeddings and self.hidden_size < 32:
            raise ValueError(f"--value-embeddings: the value gate reads 32 channels of the "
                             f"attention input; --hidden-size {self.hidden_size} is smaller")
        if self.squared_relu and self.swiglu:
            raise ValueError("--squared-relu and --swiglu are two MLP activations; pass one of "
                             "them (Megatron-LM refuses both too)")


@dataclass
class LoopConfig:
    """The recurrence: layout P + K x T + C and the exit objective."""

    num_loops: int = 1
    """T: how many times the core runs (1 = an ordinary dense model)."""

    num_prelude_layers: int = 0
    """P: layers before the loop, with their own weights (taken from --num-layers)."""

    num_coda_layers: int = 0
    """C: layers after each loop step, before the exit gate and LM head (taken from
    --num-layers)."""

    step_norm_placement: Literal["recurrent", "readout"] = "recurrent"
    """`recurrent` (Ouro): the step norm output is the next step's input; `readout`: the step norm
    only feeds the gate and head, the un-normalized state continues the loop."""

    exit_loss: Literal["expected", "smoothed", "last", "adaptive-gate"] = "expected"
    """`expected`: sum_t p_t L_t + beta KL(p || uniform); `smoothed`: the expectation mixed with the
    plain mean of step losses (Closing the Loop Eq. 2); `last`: final step's loss only, no gate;
    `adaptive-gate`: Ouro's stage II, the LM frozen and only the exit gate trained, by BCE
    towards the continue target sigmoid(k (I_t - gamma)), I_t = max(0, L_{t-1} - L_t)."""

    exit_kl_beta: float = 0.15
    """beta, the weight of KL(p || uniform) on the exit distribution (the Closing the Loop recipe's
    0.15)."""

    exit_loss_smoothing: float = 0.05
    """epsilon of the smoothed exit loss (Closing the Loop section 4.2 uses 0.05); KL uses the
    unsmoothed p."""

    gate_bce_k: float = 50.0
    """`adaptive-gate` only: steepness k of the continue target sigmoid(k (I_t - gamma))."""

    gate_bce_gamma: float = 0.005
    """`adaptive-gate` only: loss improvement gamma at which the continue target is 0.5."""

    step_norm: Literal["rms", "frms", "identity"] = "rms"
    """Norm after every loop step and the coda's final norm (Closing the Loop App. A): `rms`
    (learnable, of --normalization), `frms` (the same without a scale) or `identity` (none)."""

    input_injection: Literal["none", "scalar-mix", "scalar", "channel-wise",
                             "residual-channel-wise", "dense", "concat-linear", "parcae"] = "none"
    """What enters a core pass: `none` (the previous state h, as Ouro); `scalar-mix` (Closing the
    Loop Eq. 1, passes after the first: w src + (1 - w) h, w = sigmoid(a)); before every pass,
    Recurrence Effective's initial-state forms `scalar` (h + alpha src), `channel-wise` (a*h +
    b*src), `residual-channel-wise` ((1 + da)*h + b*src), `dense` (W_h h + W_0 src), all starting as
    the identity on h, Huginn's `concat-linear` (W [h; src], random W), or Parcae's `parcae`
    (exp(-dt A) * h + dt * (B src), dt = softplus(dt_bias), A = exp(A_log) per channel, B dense,
    starting at decay sqrt(1/5) and B = I)."""

    injection_source: Literal["embedding", "prelude"] = "embedding"
    """The injected src: the token embedding, or the prelude output (the same without a prelude)."""

    injection_init_weight: float = 0.99
    """Initial w of `scalar-mix` injection (Closing the Loop starts at 0.99); in (0, 1)."""

    history_injection: Literal["none", "scalar", "channel-wise", "dense"] = "none"
    """Recurrence Effective history-state injection: z_l = h_l + sum_j B_j (h_{l-j} - h_l) over the
    last --history-window completed states (h_0 excluded); B_j per lag a scalar, a channel vector or
    a dense matrix, all starting at 0. Applied before --input-injection."""

    history_window: int = 2
    """w, the number of past states history-state injection reads (Recurrence Effective's best:
    2)."""

    timestep_conditioning: Literal["none", "loop-gating", "branch-gating", "adaln",
                                   "loopformer"] = "none"
    """Recurrence Effective timestep conditioning on psi(l/T, 1/T): `loop-gating` (h + g (F(h) - h),
    g = 1 + q.psi), `branch-gating` (each core layer's attention / MLP update scaled by 1 + q_k.psi)
    or `adaln` (per layer and branch, [g - 1; s] = W_k psi: input norm scaled by 1 + s, update by
    g); all their parameters start at 0 (the unconditioned model). `loopformer` (LoopFormer):
    c = MLP_t(sin(l/T)) + MLP_dt(sin(1/T)), and per layer and branch g = W_g silu(c) + b_g,
    s = W_s silu(c) + b_s (input norm scaled by 1 + s, update by g; W, b start at 0)."""

    timestep_inference: Literal["rescaled", "prefix"] = "rescaled"
    """Timestep features when running another loop count than trained: `rescaled` (t = l / T with
    the T being run) or `prefix` (the training T: the first steps of the trained schedule)."""

    loop_resolutions: str = ""
    """SpiralFormer per-step resolution schedule r_t = 1/g_t, one per loop step, e.g.
    `1/8,1/4,1/2,1`; `coarse-to-fine` derives r_t = 2 r_{t-1} ending at 1 from --num-loops; empty:
    every step at full resolution (the plain loop). A coarse step needs --loop-topology anchor or
    mesh. See megaloop/model/spiral.py."""

    resolution_offset: Literal["half", "zero"] = "half"
    """Chunk offset omega_t of --loop-resolutions: `half` floor(g_t/2) (SpiralFormer's default) or
    `zero`."""

    resolution_shift: Literal["overlap", "parallel"] = "overlap"
    """Causal right shift s_t of a coarse step's update: `overlap` g_t - 1 (SpiralFormer's default,
    one token of overlap) or `parallel` g_t (a chunk reads earlier chunks only)."""

    resolution_down: Literal["mean", "self-aggregation"] = "self-aggregation"
    """Down-scaling of a coarse step: `mean` pooling or learned `self-aggregation` (per-step scorer,
    softmax within the chunk)."""

    resolution_up: Literal["broadcast", "allocation"] = "allocation"
    """Up-scaling of a coarse step (gain sqrt(g_t)): uniform `broadcast` or output-dependent
    `allocation` (per-step softmax over the g_t slots of a chunk)."""

    loop_topology: Literal["plain", "anchor", "mesh"] = "plain"
    """State update between loop steps (SpiralFormer section 2.1): `plain` h_{t+1} = u~_t, `anchor`
    h_{t+1} = u~_t + h_0, `mesh` a buffer of --mesh-slots slots with per-step write/read routers."""

    mesh_slots: int = 0
    """B, the MeSH buffer slots (0 = --num-loops + 3, as MeSH)."""

    lora_rank: int = 0
    """Stepwise LoRA (Closing the Loop section 4.4): rank of one adapter per loop step on each core
    attention and MLP linear (0 = off). B starts at 0, so the model starts equal to the one without
    LoRA."""

    lora_alpha: Optional[float] = None
    """LoRA scaling numerator: the adapter output is scaled by alpha / rank (default: alpha =
    rank, scale 1)."""

    state_init: Literal["prelude", "noise"] = "prelude"
    """The state entering step 1: the prelude's output (or the embedding without a prelude), or
    Huginn's random state, drawn per token from a normal truncated at 3 sigma (std
    sqrt(2 / (5 d)) x --state-init-scale) and multiplied by --embedding-scale; the tokens then reach the loop only
    through --input-injection (megaloop/model/initial_state.py)."""

    state_init_scale: float = 1.0
    """Multiplies the sigma of --state-init noise, Huginn's sqrt(2 / (5 x hidden size)) (Huginn's
    ``init_scale``; 0: the loop starts from zeros, deterministically)."""

    share_final_norm: bool = False
    """The step norm is also the coda's final norm: one module applied after the loop step and
    again after the coda (Huginn's ``ln_f``); needs a coda."""

    random_depth_mean: float = 0.0
    """Huginn random depth (0 = off): every optimizer step runs T ~ Poisson(e^tau) + 1 loops,
    tau ~ N(log(mean) - sigma^2/2, sigma), drawn from (seed, iteration), the same on every rank.
    Validation keeps --num-loops."""

    random_depth_sigma: float = 0.5
    """sigma of the log-normal rate of --random-depth-mean (Huginn: 0.5)."""

    random_depth_max: int = 0
    """Cap on the drawn loop count (0 = no cap; the log-normal tail can draw large T)."""

    truncated_backprop_steps: int = 0
    """Truncated backpropagation: the first n loop steps of every training forward run without
    gradient (at most T - 1, so the last step always trains); 0 = full backpropagation."""

    backprop_last_steps: int = 0
    """Truncated backpropagation from the end: only the last k loop steps of every training
    forward run with gradient (Huginn's ``mean_backprop_depth``, 8); 0: --truncated-backprop-steps
    decides. With random depth the truncation follows the drawn T."""

    # --- per-step readout (megaloop/model/readout.py)

    loop_readout: Literal["logits", "chunked"] = "logits"
    """How a read-out step's LM loss is computed in training: `logits` (megatron-core's head,
    then its vocab-parallel cross-entropy; each read-out step's [s, b, V/tp] fp32 softmax is kept
    for the backward) or `chunked` (the same head and cross-entropy over chunks of
    --loop-readout-chunk-tokens tokens, logits recomputed in the backward: a step keeps ~17 bytes
    per token, for one more head GEMM per read-out step). Same loss and gradients. Inference
    returns logits either way."""

    loop_readout_chunk_tokens: int = 1024
    """`--loop-readout chunked`: tokens (sequence x micro-batch, per rank) whose fp32 logits
    [tokens, V/tp] exist at once."""

    timestep_frequency_dim: int = 256
    """`--timestep-conditioning loopformer`: size of the sinusoidal embedding of the step's time t
    and of its size dt before each one's Linear-SiLU-Linear (LoopFormer: 256); even."""

    loopformer_objective: bool = False
    """Train as LoopFormer does: every micro-batch also runs a random shorter route of unequal
    steps, loss = CE(full) + 0.1 CE(short) + 0.1 MSE(stop-gradient of the full route's final
    normed state, the short route's) (megaloop/model/shortcut_objective.py). Needs
    --timestep-conditioning loopformer, --exit-loss last, no coda and no random depth."""

    injection_source_norm: bool = False
    """Normalize the injected src once, before the loop, with a learnable norm of --normalization
    (Parcae's prelude norm: the prelude output is RMS-normed once, then injected at every
    step); needs --input-injection."""

    readout_projection: bool = False
    """A learned [d, d] linear between each step's state and its readout (coda, gate, head): the
    readout reads C h_t while h_t itself continues the loop (Parcae's C, drawn orthogonal with
    gain --init-method-std x sqrt(d)); after --step-norm, so it needs --step-norm-placement
    readout and no --share-final-norm. The coda's final norm then stays the learnable norm of
    --normalization whatever --step-norm says (Parcae: no norm between passes, ln_f after the
    coda)."""

    def num_core_layers(self, num_layers: int) -> int:
        return num_layers - self.num_prelude_layers - self.num_coda_layers

    def effective_depth(self, num_layers: int) -> int:
        """P + K*T + C: layers a token passes through once (the issue's definition)."""
        return self.num_prelude_layers + self.num_core_layers(num_layers) * self.num_loops + \
            self.num_coda_layers

    @property
    def gated(self) -> bool:
        """Whether an exit gate exists: more than one step and an objective that uses it."""
        return self.num_loops > 1 and self.exit_loss != "last"

    def supports(self, *, depth: Optional[int] = None, exit=None, kv_policy: Optional[str] = None,
                 export: Optional[str] = None, model: Optional[ModelConfig] = None,
                 sequence_parallel: bool = False, spell=None) -> Optional[str]:
        """None if a model of this loop config can run what is asked, else a one-line reason
        naming the flag and the fix: a loop count ``depth``; an exit rule (an ExitRule of
        megaloop/model/exit_rules.py), in decoding under ``kv_policy`` when given, else in
        teacher-forced scoring; ``export="hf"`` (with ``model``, its architecture too); a
        ``sequence_parallel`` layout. ``spell``: how the caller writes a flag name (default
        ``--num-loops``). The rules: megaloop/model/supports.py."""
        from megaloop.model.supports import Request, supports

        request = Request(depth=depth, exit=exit, kv_policy=kv_policy, export=export,
                          model=model, sequence_parallel=sequence_parallel)
        if spell is not None:
            request.spell = spell
        return supports(self, request)

    def validate(self, num_layers: int) -> None:
        if self.num_loops < 1:
            raise ValueError(f"--num-loops {self.num_loops} must be at least 1 (1 = dense model)")
        if self.num_prelude_layers < 0 or self.num_coda_layers < 0:
            raise ValueError("--num-prelude-layers and --num-coda-layers must be >= 0")
        if self.num_core_layers(num_layers) < 1:
            raise ValueError(
                f"--num-layers {num_layers} leaves no core layer after --num-prelude-layers "
                f"{self.num_prelude_layers} and --num-coda-layers {self.num_coda_layers}; "
                f"raise --num-layers or lower the prelude/coda sizes")
        if self.exit_kl_beta < 0:
            raise ValueError(f"--exit-kl-beta {self.exit_kl_beta} must be >= 0")
        if self.exit_loss == "adaptive-gate" and self.num_loops < 2:
            raise ValueError("--exit-loss adaptive-gate trains the exit gate between steps: it "
                             f"needs --num-loops >= 2 (got {self.num_loops})")
        if not 0.0 <= self.exit_loss_smoothing <= 1.0:
            raise ValueError(f"--exit-loss-smoothing {self.exit_loss_smoothing} must be in [0, 1]")
        if not 0.0 < self.injection_init_weight < 1.0:
            raise ValueError(f"--injection-init-weight {self.injection_init_weight} must be in "
                             f"(0, 1): w = sigmoid(a) never reaches 0 or 1; try 0.99")
        if self.history_window < 1:
            raise ValueError(f"--history-window {self.history_window} must be >= 1")
        if self.history_injection != "none" and self.num_loops < 3:
            raise ValueError(f"--history-injection {self.history_injection} needs --num-loops >= 3 "
                             f"(the window excludes h_0, so passes 1 and 2 read no history); "
                             f"raise --num-loops or use --history-injection none")
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank {self.lora_rank} must be >= 0 (0 turns LoRA off)")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ValueError(f"--lora-alpha {self.lora_alpha} must be positive (or omit it for "
                             f"alpha = rank)")
        if self.random_depth_mean < 0 or self.random_depth_sigma < 0:
            raise ValueError("--random-depth-mean and --random-depth-sigma must be >= 0 "
                             "(--random-depth-mean 0 turns random depth off)")
        if self.truncated_backprop_steps < 0 or self.random_depth_max < 0:
            raise ValueError("--truncated-backprop-steps and --random-depth-max must be >= 0")
        if self.backprop_last_steps < 0:
            raise ValueError(f"--backprop-last-steps {self.backprop_last_steps} must be >= 0 "
                             f"(0: every step trains)")
        if self.backprop_last_steps and self.truncated_backprop_steps:
            raise ValueError("--backprop-last-steps counts the steps that train from the end, "
                             "--truncated-backprop-steps the ones that do not from the start: "
                             "pass one of them")
        if self.state_init == "noise" and self.input_injection == "none":
            raise ValueError("--state-init noise starts the loop from random numbers: the tokens "
                             "reach it only through an injection; add --input-injection "
                             "concat-linear --injection-source prelude (Huginn's adapter)")
        if self.state_init_scale < 0:
            raise ValueError(f"--state-init-scale {self.state_init_scale} must be >= 0 (0: the "
                             f"zero state)")
        if self.state_init_scale != 1.0 and self.state_init != "noise":
            raise ValueError("--state-init-scale scales the initial noise; it needs --state-init "
                             "noise")
        if self.share_final_norm and not self.num_coda_layers:
            raise ValueError("--share-final-norm makes the step norm the coda's final norm too; "
                             "it needs --num-coda-layers >= 1")
        if self.loop_readout_chunk_tokens < 1:
            raise ValueError(f"--loop-readout-chunk-tokens {self.loop_readout_chunk_tokens} must "
                             f"be >= 1")
        if self.timestep_frequency_dim < 2 or self.timestep_frequency_dim % 2:
            raise ValueError(f"--timestep-frequency-dim {self.timestep_frequency_dim} must be an "
                             f"even number >= 2 (cosines and sines in halves; LoopFormer: 256)")
        if self.timestep_frequency_dim != 256 and self.timestep_conditioning != "loopformer":
            raise ValueError(f"--timestep-frequency-dim {self.timestep_frequency_dim} sizes "
                             f"LoopFormer's step embedding; it needs --timestep-conditioning "
                             f"loopformer, not {self.timestep_conditioning}")
        if self.loopformer_objective:
            needs = [(self.timestep_conditioning == "loopformer",
                      f"--timestep-conditioning loopformer (not {self.timestep_conditioning})"),
                     (self.exit_loss == "last", f"--exit-loss last (not {self.exit_loss})"),
                     (self.num_loops >= 2, f"--num-loops >= 2 (not {self.num_loops})"),
                     (self.num_coda_layers == 0 and self.step_norm_placement == "readout",
                      "no coda and --step-norm-placement readout (the state it compares is the "
                      "head's input)"),
                     (self.random_depth_mean <= 0, "no --random-depth-mean (the full route is "
                                                   "--num-loops steps)")]
            missing = [what for ok, what in needs if not ok]
            if missing:
                raise ValueError(f"--loopformer-objective needs {'; '.join(missing)}")
        if self.injection_source_norm and self.input_injection == "none":
            raise ValueError("--injection-source-norm normalizes the injected source: it needs "
                             "an --input-injection (Parcae: --input-injection parcae)")
        if self.readout_projection and self.step_norm_placement != "readout":
            raise ValueError("--readout-projection projects the state the readout reads; with "
                             "--step-norm-placement recurrent the projected state would continue "
                             "the loop: add --step-norm-placement readout")
        if self.readout_projection and self.share_final_norm:
            raise ValueError("--readout-projection sits after the step norm, which "
                             "--share-final-norm applies again after the coda: drop one of them")
        from megaloop.model.spiral_schedule import validate_loop

        validate_loop(self)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Pad the vocabulary so every tensor-parallel shard is equal.

    Megatron-LM pads to a multiple of divisible_by x TP, which changes the model (extra softmax
    columns, other initial weights) when only TP changes. megaloop pads to a multiple of
    divisible_by and goes to divisible_by x TP only when TP does not divide that, so the same
    run at TP=1, 2, 4, ... is the same model and checkpoints keep their shapes across TP sizes.
    """
    padded = int(math.ceil(vocab_size / divisible_by) * divisible_by)
    if padded % tp_size:
        multiple = divisible_by * tp_size
        padded = int(math.ceil(vocab_size / multiple) * multiple)
    return padded


def use_transformer_engine(model: ModelConfig) -> bool:
    """Whether the layers are Transformer Engine's: never without a GPU; `transformer_engine`
    on a GPU (RunConfig.validate checks that TE is installed); `auto` where TE imports."""
    import torch

    if model.transformer_impl == "local":
        return False
    if not torch.cuda.is_available():
        # Also for transformer_engine, Megatron-LM's default: its kernels need a GPU, and a
        # CPU run (tests, the demo) is the local spec whatever the flag says.
        return False
    if model.transformer_impl == "transformer_engine":
        return True
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def kernel_settings(model: ModelConfig, *, cuda: bool, te: bool,
                    fused_softmax: bool = True) -> dict:
    """TransformerConfig fields for fusions, attention backend and FP8: a pure function of the
    flags, whether a GPU is used (``cuda``), whether the layers are Transformer Engine's (``te``)
    and whether apex's fused softmax kernel exists (``fused_softmax``), so a CPU test can check
    every combination. Rules that depend on the loop or the data (a TE layer repeated T times,
    an explicit attention mask) are refused by RunConfig.validate, not silently changed here.

    - Without a GPU every fusion is off (no CPU kernel, or a slow torch.compile) and FP8 is off.
    - RoPE fusion is Transformer Engine's kernel: TE spec and rotary embeddings only.
    - Masked-softmax fusion only exists in the local spec's attention (apex kernel).
    - persist_layer_norm is never on: megatron-core's torch RMSNorm wrapper asserts on it, and the
      TE norms do not read it.
    - FP8 exists only in TE layers: a local-spec model (e.g. a checkpoint loaded on CPU) computes
      in its usual precision.
    """
    from megatron.core.transformer.enums import AttnBackend

    gpu = bool(cuda)
    out = dict(
        bias_activation_fusion=gpu and model.swiglu and not model.no_bias_swiglu_fusion,
        masked_softmax_fusion=(gpu and not te and fused_softmax
                               and not model.no_masked_softmax_fusion),
        bias_dropout_fusion=gpu and not model.no_bias_dropout_fusion,
        apply_rope_fusion=(gpu and te and model.position_embedding_type == "rope"
                           and not model.no_rope_fusion),
        persist_layer_norm=False,
        gradient_accumulation_fusion=(gpu and model.gradient_accumulation_fusion
                                      and not model.no_gradient_accumulation_fusion),
        cross_entropy_loss_fusion=gpu and model.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=model.cross_entropy_fusion_impl,
        attention_backend=AttnBackend[model.attention_backend],
    )
    if gpu and te and model.fp8_format is not None:
        out.update(
            fp8=model.fp8_format,
            fp8_recipe=model.fp8_recipe,
            fp8_margin=model.fp8_margin,
            fp8_amax_history_len=model.fp8_amax_history_len,
            fp8_amax_compute_algo=model.fp8_amax_compute_algo,
            fp8_param=model.fp8_param_gather,
            first_last_layers_bf16=model.first_last_layers_bf16,
            num_layers_at_start_in_bf16=model.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=model.num_layers_at_end_in_bf16,
        )
    return out


def fp8_gemm_dims(run) -> list:
    """(what, size per rank, how to fix it) of every dimension of the Transformer Engine GEMMs of
    a RunConfig ``run``: the linears' sizes per tensor-parallel shard and the tokens one rank
    multiplies (micro-batch x sequence, split over context-parallel ranks, and over TP ranks
    under sequence parallelism; a coarse SpiralFormer step has floor(L / g_t) positions)."""
    from megaloop.model.spiral_schedule import chunk_sizes

    m, par, tr = run.model, run.parallel, run.training
    tp = par.tensor_model_parallel_size
    cp = getattr(par, "context_parallel_size", 1)
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    tp_fix = "choose sizes that are multiples of it per --tensor-model-parallel-size shard"
    dims = [
        ("--hidden-size", m.hidden_size, "choose another --hidden-size"),
        ("the attention output width per TP shard (heads x kv-channels / TP)",
         m.num_attention_heads * kv // tp, tp_fix),
        ("the QKV width per TP shard ((heads + 2 x query groups) x kv-channels / TP)",
         (m.num_attention_heads + 2 * groups) * kv // tp, tp_fix),
        ("--ffn-hidden-size per TP shard", ffn // tp, tp_fix),
    ]
    split = cp * (tp if par.sequence_parallel else 1)
    for g in sorted(set(chunk_sizes(run.loop))):
        positions = tr.seq_length // g
        what = "tokens per rank (micro-batch x sequence" + (
            f" / {split} ranks" if split > 1 else "") + (
            f", at a loop step of resolution 1/{g}" if g > 1 else "") + ")"
        dims.append((what, tr.micro_batch_size * positions // split,
                     "change --seq-length or --micro-batch-size"))
    return dims


def _fused_softmax_available() -> bool:
    """Whether apex's fused causal softmax kernel (megatron-core's masked-softmax fusion) exists."""
    import importlib.util

    return importlib.util.find_spec("scaled_upper_triang_masked_softmax_cuda") is not None


def transformer_config(model: ModelConfig, num_layers: int, *, tp_size: int = 1,
                       sequence_parallel: bool = False, bf16: bool = False,
                       recompute: Optional[dict] = None, cuda: Optional[bool] = None,
                       te: Optional[bool] = None, fp16: bool = False):
    """The megatron-core TransformerConfig of one block of `num_layers` layers. ``cuda`` / ``te``
    default to this machine's (a GPU is present; megaloop.model.config.use_transformer_engine);
    tests pass them to check another machine's config. ``bf16`` / ``fp16``: the parameters'
    and activations' dtype (fp16 only for inference: the trainer refuses --fp16, which would need
    loss scaling)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    if bf16 and fp16:
        raise ValueError("bf16 and fp16: a model is held in one precision")
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    if cuda is None:
        cuda = torch.cuda.is_available()
    if te is None:
        te = use_transformer_engine(model)
    kernels = kernel_settings(model, cuda=cuda, te=te,
                              fused_softmax=cuda and _fused_softmax_available())
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_zero_centered_gamma=model.apply_layernorm_1p,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=_activation(model.swiglu, model.squared_relu),
        add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=model.add_qkv_bias or model.qk_bias,
        rotary_interleaved=model.rotary_interleaved,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=_context_parallel_size(),
        sequence_parallel=sequence_parallel,
        bf16=bf16,
        fp16=fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # On CPU and GPU alike, every rank draws its slice of each weight on the host from the
        # seed (megaloop.model.sharded_init: entry (i, j) of a weight is the same number at any
        # TP degree, and a rank draws only its shard; the trainer then moves the module to its
        # GPU), which TP/SP/PP equivalence tests and runs resumed at another layout rely on. On
        # GPU, per-device initialisation would draw each slice from that rank's own RNG stream,
        # so the weights would depend on the TP degree.
        use_cpu_initialization=True,
        # Fusions (off on CPU: no CPU kernel, or a slow torch.compile), attention backend, FP8.
        **kernels,
        calculate_per_token_loss=True,
        **(recompute or {}),
    )
    return cfg


def _context_parallel_size() -> int:
    """The CP size of megatron-core's parallel state (initialised from --context-parallel-size),
    1 before any group exists (config translation without a process group)."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_group(check_initialized=False) is None:
        return 1
    return parallel_state.get_context_parallel_world_size()


def _activation(swiglu: bool, squared_relu: bool = False):
    import torch.nn.functional as F

    if squared_relu:
        from megatron.core.activations import squared_relu as relu2

        return relu2
    return F.silu if swiglu else F.gelu


def with_layers(config, num_layers: int):
    """A copy of a TransformerConfig for a block of another size (prelude, core, coda)."""
    return dataclasses.replace(config, num_layers=num_layers)
