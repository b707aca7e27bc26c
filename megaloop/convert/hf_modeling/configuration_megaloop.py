"""Configuration of a looped language model exported by megaloop (loaded with trust_remote_code).

Keys follow Hugging Face's Qwen3 / Llama names where the concept exists there, and Ouro's for the
loop (``total_ut_steps``: how many times the looped stack runs). The megaloop-specific keys
default to the Ouro layout, so an Ouro-style model carries nothing unfamiliar.
"""

from transformers import PretrainedConfig


class MegaloopConfig(PretrainedConfig):
    model_type = "megaloop"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,  # layers of the looped stack (the core)
        num_attention_heads=16,
        num_key_value_heads=None,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,  # Llama 3.x frequency scaling: {"rope_type": "llama3", "factor", ...}
        rope_parameters=None,  # the same as transformers >= 5 saves it (rope_theta inside)
        qkv_bias=False,  # a bias on the q, k, v projections (Qwen2)
        initializer_range=0.02,
        tie_word_embeddings=False,
        total_ut_steps=4,  # loop count T (Ouro's name); can be overridden per call
        norm_scheme="ouro",  # "ouro": input and output norm per sub-layer; "pre": pre-norm
        qk_norm=False,  # per-head RMSNorm of queries and keys (Qwen3)
        num_prelude_layers=0,
        num_coda_layers=0,
        step_norm_placement="recurrent",  # "recurrent": the normalized state feeds the next step
        use_exit_gate=True,
        input_injection="none",  # "none" or "scalar-mix": z = w src + (1 - w) h, w = sigmoid(a)
        injection_source="embedding",  # or "prelude"
        lora_rank=0,  # stepwise LoRA on the looped stack's projections
        lora_alpha=None,
        lora_steps=0,  # adapters stored; later steps reuse the last one
        layer_types=None,
        use_sliding_window=False,
        sliding_window=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        # Kept as transformers >= 5 keeps it (``rope_parameters``, validated by it), and only when
        # scaled: a plain-RoPE config stays exactly as before (Ouro's keys).
        scaling = rope_parameters or rope_scaling
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            self.rope_parameters = {**scaling, "rope_theta": rope_theta}
        self.qkv_bias = qkv_bias
        self.initializer_range = initializer_range
        self.total_ut_steps = total_ut_steps
        self.norm_scheme = norm_scheme
        self.qk_norm = qk_norm
        self.num_prelude_layers = num_prelude_layers
        self.num_coda_layers = num_coda_layers
        self.step_norm_placement = step_norm_placement
        self.use_exit_gate = use_exit_gate
        self.input_injection = input_injection
        self.injection_source = injection_source
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_steps = lora_steps
        # Ouro's loaders read these: every layer is full attention.
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class OuroConfig(MegaloopConfig):
    """The same model under Ouro's model type, for Ouro-style exports (Ouro's names and keys)."""

    model_type = "ouro"
