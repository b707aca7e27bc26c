"""``--cuda-graphs`` (megaloop/inference/cuda_graphs.py): decode forwards of static shapes.

On CPU nothing is captured; what a graph needs is checked instead. The static forwards decode the
tokens of the ordinary ones, to within a few float32 ulps of their log-probabilities (a float64
model, as in tests/test_layer_forward.py), across a gathered view's whole life and a fresh
gather after it; and every tensor call of one view's decode forwards has the same shapes at
every step (recorded with a TorchFunctionMode), which the ordinary forwards, whose attention
reads a prefix that grows by one per step, do not (so the check can fail). Combinations that
cannot be static are refused by flag. On a GPU, the captured and replayed forwards give the
ordinary forwards' greedy tokens (marked ``gpu``: not run without one).
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from distributed import run_distributed, setup_parallel
from flags import llama_style

VOCAB, V = 256, 250
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24]]
MAX_TOKENS = 40  # past the view's 32 spare columns: a fresh gather mid-way


def _model():
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    torch.manual_seed(3)
    model = build_model(llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    max_position_embeddings=128, transformer_impl="local"),
                        LoopConfig(num_loops=3, num_prelude_layers=1, num_coda_layers=1),
                        VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _engine(model, graphs, **kw):
    from megaloop.inference.engine import EngineConfig, InferenceEngine

    return InferenceEngine(model, V, config=EngineConfig(
        max_sequence_length=64, max_batch=4, block_size=4, cuda_graphs=graphs), **kw)


def _decode(model, graphs):
    from megaloop.inference.generate import SamplingParams

    engine = _engine(model, graphs)
    requests = [engine.add(p, MAX_TOKENS, SamplingParams(seed=i), record_logprobs=True,
                           ignore_eos=True) for i, p in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    return [(r.out, torch.stack(r.logprobs)) for r in requests], engine.stats["gathers"]


class _Shapes(TorchFunctionMode):
    """The (call, argument shapes) of every torch call made under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.calls.append((getattr(func, "__name__", str(func)), shapes))
        return func(*args, **(kwargs or {}))


def _shapes_per_step(model, graphs, steps=4):
    """Each decode step's calls inside the model forward (the same rows, one view)."""
    from megaloop.inference.generate import SamplingParams

    engine = _engine(model, graphs)
    for i, p in enumerate(PROMPTS):
        engine.add(p, 12, SamplingParams(seed=i), ignore_eos=True)
    engine.step()  # the prefill
    engine.step()  # the first decode: gathers the view the next steps reuse
    seen = []
    forward = model.forward

    def recorded(*args, **kwargs):
        with _Shapes() as mode:
            out = forward(*args, **kwargs)
        seen.append(mode.calls)
        return out

    before = engine.stats["gathers"]
    model.forward = recorded
    for _ in range(steps):
        engine.step()
    model.forward = forward
    return seen, engine.stats["gathers"] - before


def _static(rank, world):
    setup_parallel(world)
    model = _model().double().eval()
    plain, plain_gathers = _decode(model, False)
    static, static_gathers = _decode(model, True)
    shapes_static, gathers = _shapes_per_step(model, True)
    shapes_plain, _ = _shapes_per_step(model, False)
    return plain, static, plain_gathers, static_gathers, shapes_static, shapes_plain, gathers


def test_static_decode_forwards_keep_tokens_and_shapes():
    plain, static, g0, g1, shapes_static, shapes_plain, gathers = \
        run_distributed(_static, 1)[0]
    assert g0 == g1 and g0 >= 2  # a fresh gather after the first view ran out
    for (tokens, logp), (tokens0, logp0) in zip(static, plain):
        assert tokens == tokens0
        bound = 8 * 2.0 ** -23 * logp0.abs().clamp(min=1.0)
        assert ((logp - logp0).abs() <= bound).all(), (logp - logp0).abs().max()
    assert gathers == 0  # the recorded steps reused one view
    assert len(shapes_static) == 4 and all(s == shapes_static[0] for s in shapes_static)
    assert any(s != shapes_plain[0] for s in shapes_plain[1:])  # (the check can fail)


def _refusals(rank, world):
    from megaloop.inference.early_exit import parse_exit

    setup_parallel(world)
    model = _model().eval()
    out = []
    for kw in ({"exit_rule": parse_exit("q:0.5")}, {"kv_policy": "last-step"}):
        try:
            _engine(model, True, **kw)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_what_cannot_be_static_is_refused_by_flag():
    exit_rule, policy = run_distributed(_refusals, 1)[0]
    assert exit_rule and "--cuda-graphs" in exit_rule and "--exit" in exit_rule
    assert policy and "--cuda-graphs" in policy and "--kv-policy" in policy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_decode_the_ordinary_tokens():
    """A GPU: the greedy tokens of captured and replayed forwards == the ordinary forwards'."""
    def body(rank, world):
        setup_parallel(world)
        model = _model().cuda().eval()
        plain, _ = _decode(model, False)
        engine_tokens, _ = _decode(model, True)
        return [t for t, _ in plain], [t for t, _ in engine_tokens]

    plain, graphed = run_distributed(body, 1)[0]
    assert plain == graphed
