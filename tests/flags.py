"""What the tests were written for, spelled out. megaloop's flags take Megatron-LM's defaults
(GELU MLP, learned absolute positions, LayerNorm, dropout 0.1, linear biases, linear LR decay, 100 validation
iterations, a line every 100 iterations, 2 loader workers, Transformer Engine layers, nccl);
the tests build the Llama-style model of megaloop's recipes (SwiGLU, RoPE, RMSNorm, no biases,
no dropout,
which equivalence tests need: dropout masks differ between layouts) and keep their runs short
and in one process, so they pass these choices explicitly."""

from megaloop.model.config import ModelConfig

LLAMA_STYLE = {"swiglu": True, "position_embedding_type": "rope", "normalization": "RMSNorm",
               "hidden_dropout": 0.0, "attention_dropout": 0.0, "disable_bias_linear": True}

LLAMA_STYLE_FLAGS = ["--swiglu", "--position-embedding-type", "rope", "--normalization",
                     "RMSNorm", "--hidden-dropout", "0", "--attention-dropout", "0",
                     "--disable-bias-linear"]

# Put first: a test's own later value of the same flag wins (argparse keeps the last).
TEST_FLAGS = LLAMA_STYLE_FLAGS + [
    "--lr-decay-style", "cosine", "--eval-iters", "10", "--log-interval", "10",
    "--num-workers", "0", "--transformer-impl", "auto", "--distributed-backend", "auto"]


def llama_style(**kw) -> ModelConfig:
    """A ModelConfig with the Llama-style choices; ``kw`` overrides them."""
    return ModelConfig(**{**LLAMA_STYLE, **kw})
