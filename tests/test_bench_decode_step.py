"""benchmarks/decode_step.py's profile attributes a decode step's time to the parts that spend
it: with either layer forward, the wrapped functions are the ones the engine calls (each part
that every decode step runs is seen taking time, so a refactor that bypasses a wrapper shows up
here instead of moving that time into "rest" unnoticed), the parts never add up to more than the
step, and the engine decoded with the forward each row of the table names."""

import importlib.util
import os
import sys

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_decode_step", os.path.join(ROOT, "benchmarks", "decode_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile(rank, world):
    from distributed import setup_parallel
    from flags import llama_style
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    setup_parallel(world)
    bench = _bench()
    model = build_model(llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    max_position_embeddings=64, transformer_impl="local"),
                        LoopConfig(num_loops=3), 128).eval()
    return {layers: bench.decode(model, 120, 2, 5, 6, layers)
            for layers in ("auto", "megatron-core")}


def test_profile_sees_every_part_with_either_forward():
    out = run_distributed(_profile, 1)[0]
    for layers, (step, parts, impl) in out.items():
        assert impl.startswith("megaloop" if layers == "auto" else "megatron-core"), impl
        assert set(parts) == set(_bench().PARTS)
        for part in ("transfer", "view", "blocks", "head", "sampling", "write-back"):
            assert parts[part] > 0, (layers, part)
        assert sum(parts.values()) <= step
