"""tools/serve.py serves what the batching engine's ``private`` layout decodes
(megaloop/inference/engine.py, ``layout``): a SpiralFormer checkpoint (its coarse steps' chunk
latents live in a cache per request), with the default ``--kv-policy full`` and with
``--kv-policy none`` (no cache: the whole sequence recomputed per token). Neither is refused; a
real server process answers the greedy tokens of the saved model, decoded independently by full
forwards of the in-memory model. (The engine's own check of both layouts against recomputation,
sampled too: tests/test_engine.py, test_other_layouts_decode_as_recomputation.)"""

import dataclasses

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from distributed import run_distributed, setup_parallel  # noqa: E402
from flags import llama_style  # noqa: E402
from test_serve_te_checkpoint import _greedy  # noqa: E402

TABLE = 256  # embedding rows (a multiple of 128: no padding)
V = 200  # the null tokenizer's ids before EOD; EOD = V
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]
MAX_TOKENS = 8


def _save(rank, world, save):
    """A SpiralFormer checkpoint (the local layers, random weights); the independent greedy
    continuations of PROMPTS."""
    from megaloop.checkpoint.save import save_weights
    from megaloop.data.config import TokenizerConfig
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.model.spiral_schedule import is_active

    setup_parallel(1)
    model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                            max_position_embeddings=64, transformer_impl="local")
    loop = LoopConfig(num_loops=2, loop_resolutions="1/2,1", loop_topology="anchor")
    model = build_model(model_cfg, loop, TABLE, tp_size=1)
    assert is_active(model.loop)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.eval()
    run = {"model": dataclasses.asdict(model_cfg), "loop": dataclasses.asdict(loop),
           "tokenizer": dataclasses.asdict(TokenizerConfig("NullTokenizer", None, V))}
    save_weights(save, 1, model, run_config=run)
    return [_greedy(model, p, MAX_TOKENS, V) for p in PROMPTS]


@pytest.mark.parametrize("policy", ["full", "none"])
def test_a_spiral_checkpoint_is_served_with_and_without_a_kv_cache(policy, tmp_path):
    from test_serve import serving

    path = str(tmp_path / "ckpt")
    want = run_distributed(_save, 1, path)[0]
    log = str(tmp_path / "server.log")
    with serving(path, ["--kv-policy", policy], log) as (client, _):
        r = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        stats = client.get("/stats").json()
    for text, ids in zip(texts, want):
        # (the server does not return the end-of-document token's text)
        assert [int(x) for x in text.split()] == (ids[:-1] if ids and ids[-1] == V else ids)
    assert f"kv-policy {policy}" in open(log).read()
    assert stats["decode_forwards"] > 0  # (decoded by the engine)
