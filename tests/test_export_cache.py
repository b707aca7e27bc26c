"""The exported modeling file's key/value cache, against the same file without it and megaloop.

A megaloop-native model (every optional piece the modeling file implements: prelude, coda,
QK-norm, GQA, LoRA per step, scalar-mix injection; or Ouro's norms with an exit gate) is saved,
exported and loaded in `transformers` here. With the cache:
- decoding token by token gives the logits of one full forward over the whole sequence, at the
  trained depth, at another depth and under Ouro's exit rule (each token's step chosen by the
  gate);
- greedy ``generate()`` of a left-padded batch returns the tokens of ``use_cache=False`` and of
  megaloop's own Generator (each prompt alone), and every forward after the first reads one new
  token per row (the prefix is not re-run: a forward hook on the embedding counts them);
- a cache filled at fewer loop steps than a call asks for is refused by name.
"""

import os

import pytest
import torch

from distributed import run_distributed
from flags import llama_style

VOCAB, PAD = 150, 0
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [12, 7, 130]]
NEW = 8


def _build(rank, world, out, kind):
    from megaloop.convert.hf_export import export_hf
    from megaloop.data.config import TokenizerConfig
    from megaloop.inference.generate import Generator
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize
    from megaloop.training.checkpointing import save_checkpoint
    from megaloop.training.run_config import RunConfig

    initialize(ParallelConfig(), 3)
    if kind == "ouro":
        model_cfg = llama_style(num_layers=2, hidden_size=32, num_attention_heads=4,
                                max_position_embeddings=64, norm_scheme="ouro",
                                untie_embeddings_and_output_weights=True, norm_epsilon=1e-6)
        loop = LoopConfig(num_loops=3)
    else:
        model_cfg = llama_style(num_layers=4, hidden_size=32, num_attention_heads=4,
                                num_query_groups=2, kv_channels=12, qk_layernorm=True,
                                max_position_embeddings=64, norm_scheme="pre")
        loop = LoopConfig(num_loops=3, num_prelude_layers=1, num_coda_layers=1,
                          step_norm_placement="readout", input_injection="scalar-mix",
                          injection_source="prelude", lora_rank=2, lora_alpha=4.0)
    model = build_model(model_cfg, loop, 200, tp_size=1).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a random model at init is nearly uniform: give it preferences
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    assert len(model.core.layers) == 2, "two core layers besides the prelude and coda"
    run = RunConfig(model=model_cfg, loop=loop,
                    tokenizer=TokenizerConfig("NullTokenizer", None, VOCAB - 1)).to_dict()
    ckpt = os.path.join(out, "ckpt")
    save_checkpoint(ckpt, 1, model, run_config=run)
    export_hf(ckpt, os.path.join(out, "hf"), vocab_size=VOCAB)
    return [Generator(model, VOCAB).generate([p], NEW)[0] for p in PROMPTS]


@pytest.fixture(scope="module", params=["everything", "ouro"])
def exported(request, tmp_path_factory):
    import transformers

    out = str(tmp_path_factory.mktemp(request.param))
    expected = run_distributed(_build, 1, out, request.param)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"),
                                                              trust_remote_code=True).eval()
    return request.param, model, expected


def _padded(rows):
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _calls(kind):
    calls = [{}, {"num_loops": 5}]
    if kind == "ouro":  # Ouro's rule: each token's step from the gate, and a fixed step
        calls += [{"exit_threshold": 0.5}, {"exit_at_step": 1}]
    return calls


def test_cached_decoding_gives_the_full_forward_logits(exported):
    from transformers import DynamicCache

    kind, model, _ = exported
    ids, mask = _padded([p + [(7 * i + 3) % VOCAB for i in range(6)] for p in PROMPTS])
    prompt = ids.shape[1] - 6
    for kw in _calls(kind):
        with torch.no_grad():
            full = model(ids, attention_mask=mask, **kw).logits
            cache = DynamicCache()
            parts = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache,
                           **kw).logits]
            for i in range(prompt, ids.shape[1]):
                parts.append(model(ids[:, i:i + 1], attention_mask=mask[:, :i + 1],
                                   cache=cache, **kw).logits)
        cached = torch.cat(parts, dim=1)
        real = mask.bool()  # padded positions' logits are not defined by either path
        err = (cached - full)[real].abs().max().item()
        assert err < 1e-4, (kind, kw, err)  # logits of order 10: fp32 summation order
        if kw.get("exit_threshold"):
            # the rule did pick different steps for different tokens (else it tests nothing)
            at_last = model(ids, attention_mask=mask).logits
            assert (at_last - full)[real].abs().max().item() > 1e-3


def test_cached_generate_is_greedy_decoding_one_token_per_forward(exported):
    kind, model, expected = exported
    ids, mask = _padded(PROMPTS)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[1]))
    greedy = {}
    try:
        for kw in _calls(kind):
            outs = {}
            for use_cache in (True, False):
                seen.clear()
                outs[use_cache] = model.generate(
                    ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                    pad_token_id=PAD, use_cache=use_cache, **kw)[:, ids.shape[1]:]
                lengths = list(seen)
            # the last loop is the uncached one: it re-reads the growing prefix
            assert lengths == list(range(ids.shape[1], ids.shape[1] + NEW)), lengths
            assert torch.equal(outs[True], outs[False]), (kind, kw)
            seen.clear()
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           pad_token_id=PAD, **kw)
            assert seen == [ids.shape[1]] + [1] * (NEW - 1), seen
            if not kw:  # at the trained depth: megaloop's greedy continuation of each prompt
                assert outs[True].tolist() == expected, (kind, outs[True].tolist(), expected)
            greedy[str(kw)] = outs[True].tolist()
    finally:
        hook.remove()
    # generate() hands num_loops and the exit arguments on to forward (they change the text)
    assert len({str(v) for v in greedy.values()}) == len(greedy), greedy


def test_a_cache_of_fewer_steps_is_refused(exported):
    from transformers import DynamicCache

    _, model, _ = exported
    cache = DynamicCache()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        model(ids, cache=cache, num_loops=2)
        with pytest.raises(ValueError, match="num_loops 3: this cache was filled at fewer"):
            model(ids[:, :1], attention_mask=torch.ones(1, ids.shape[1] + 1), cache=cache,
                  num_loops=3)
