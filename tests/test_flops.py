"""TFLOP/s accounting under random depth: an iteration counts at the loop count it ran."""

from megaloop.model.config import LoopConfig
from megaloop.training.metrics import flops_per_iteration
from flags import llama_style


def _hand_count(T, L=16, V=10, batch=2):
    """h=8, 2 heads (head dim 4, no GQA), ffn 16, SwiGLU; 1 + 1 x T + 1, exit loss `expected`
    (coda, head and the d -> 1 gate at every one of the T steps)."""
    dense = 2 * 8 * 24 + 2 * 8 * 8 + 3 * 2 * 8 * 16   # QKV, out proj, SwiGLU: 1280 / token
    layer = dense + 4 * L * 8                          # attention scores + weighted sum
    prelude, core, coda = layer, T * layer, T * layer
    head = T * (2 * 8 * V + 2 * 8)
    return 3 * batch * L * (prelude + core + coda + head)


def test_flops_at_the_drawn_depth_against_hand_count():
    model = llama_style(num_layers=3, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    loop = LoopConfig(num_loops=4, num_prelude_layers=1, num_coda_layers=1, exit_loss="expected",
                      random_depth_mean=3.0)
    drawn = flops_per_iteration(model, loop, 10, 16, global_batch=2, num_loops=3)
    assert drawn == _hand_count(3), (drawn, _hand_count(3))
    assert flops_per_iteration(model, loop, 10, 16, global_batch=2) == _hand_count(4)
    assert flops_per_iteration(model, loop, 10, 16, global_batch=2, num_loops=4) == _hand_count(4)
    assert flops_per_iteration(model, loop, 10, 16, global_batch=2, num_loops=6) == _hand_count(6)
