"""Cached decoding against the uncached forward: a prefill then one token at a time through a
LoopKVCache gives the logits of the full forward at every position, for every layout and variant;
TP=2 == TP=1; KV policies exact where they are defined to be; greedy generation with and without
a cache is identical."""

import pytest
import torch

from distributed import run_distributed, setup_parallel
from megaloop.device import current_device
from test_placement import check_placement
from reference import lm_batch
from flags import llama_style

VOCAB, SEQ, BATCH, PREFILL = 256, 12, 2, 5


def _model(model_kw: dict, loop_kw: dict):
    from megaloop.model.config import LoopConfig
    from megaloop.model.looped_gpt import build_model

    num_layers = 2 + loop_kw.get("num_prelude_layers", 0) + loop_kw.get("num_coda_layers", 0)
    model_cfg = llama_style(**{"num_layers": num_layers, "hidden_size": 32,
                               "num_attention_heads": 4, "max_position_embeddings": SEQ,
                               **model_kw})
    loop = LoopConfig(**{"num_loops": 3, **loop_kw})
    model = build_model(model_cfg, loop, VOCAB, tp_size=torch.distributed.get_world_size())
    return model.cuda(current_device())  # as a GPU run: the rank bodies run placement-checked


def _batch(batch: int):
    """lm_batch's (ids, positions, labels) on the device, where the model is."""
    return tuple(t.to(current_device()) for t in lm_batch(VOCAB, SEQ, batch))


def _perturb(model):
    """Variant parameters start at the identity (zeros): move them so they matter."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("timestep", "history", "injection", "lora_B",
                                       "spiral.steps")):
                p.add_((0.2 * torch.randn(p.shape, generator=g)).to(p))  # where p is


def _cached_vs_full(rank, world, model_kw, loop_kw, policy, run_loops):
    check_placement()
    from megatron.core import tensor_parallel

    from megaloop.inference.kv_cache import LoopKVCache

    setup_parallel(world)
    model = _model(model_kw, loop_kw)
    _perturb(model)
    model.eval()
    ids, pos, _ = _batch(BATCH)
    with torch.no_grad():
        full = model(ids, pos, None, num_loops=run_loops)
        kv = LoopKVCache(BATCH, SEQ, policy)
        cached = [model(ids[:, :PREFILL], pos[:, :PREFILL], None, num_loops=run_loops,
                        kv_cache=kv)]
        kv.advance(PREFILL)
        for j in range(PREFILL, SEQ):
            cached.append(model(ids[:, j:j + 1], pos[:, j:j + 1], None, num_loops=run_loops,
                                kv_cache=kv))
            kv.advance(1)
    cached = torch.cat(cached, 1)
    gather = tensor_parallel.gather_from_tensor_model_parallel_region
    return gather(full), gather(cached), kv.nbytes()


VARIANTS = {
    "ouro": ({}, {}),
    "prelude+coda+untied+gqa": ({"untie_embeddings_and_output_weights": True,
                                 "num_query_groups": 2},
                                {"num_prelude_layers": 1, "num_coda_layers": 1}),
    "pre+learned-positions": ({"norm_scheme": "pre", "position_embedding_type": "learned_absolute"},
                              {}),
    "scalar-mix-prelude-source": ({}, {"num_prelude_layers": 1, "input_injection": "scalar-mix",
                                       "injection_source": "prelude",
                                       "injection_init_weight": 0.7}),
    "channel-wise": ({}, {"input_injection": "channel-wise"}),
    "concat-linear": ({}, {"input_injection": "concat-linear"}),
    "history-dense": ({}, {"history_injection": "dense", "history_window": 2,
                           "input_injection": "dense"}),
    "loop-gating": ({}, {"timestep_conditioning": "loop-gating"}),
    "branch-gating-prefix": ({}, {"timestep_conditioning": "branch-gating",
                                  "timestep_inference": "prefix"}),
    "adaln-rescaled": ({"norm_scheme": "sandwich"}, {"timestep_conditioning": "adaln"}),
    "lora": ({}, {"lora_rank": 2}),
    # SpiralFormer: a coarse step's latent is computed when its chunk's last token arrives.
    "spiral-anchor": ({}, {"loop_resolutions": "1/4,1/2,1", "loop_topology": "anchor"}),
    "spiral-mesh-injection": ({}, {"loop_resolutions": "coarse-to-fine", "loop_topology": "mesh",
                                   "input_injection": "scalar-mix",
                                   "injection_init_weight": 0.7}),
    "spiral-mesh-zero-offset-parallel-mean": (
        {}, {"loop_resolutions": "1/2,1/4,1", "loop_topology": "mesh", "num_prelude_layers": 1,
             "num_coda_layers": 1, "resolution_offset": "zero", "resolution_shift": "parallel",
             "resolution_down": "mean", "resolution_up": "broadcast"}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decoding_equals_full_forward(name):
    model_kw, loop_kw = VARIANTS[name]
    # Inference depth 5 with a model trained for 3: the timestep variants extrapolate, LoRA
    # reuses its last adapter; the others at the trained depth and at 5.
    for loops in ((3,) if name.startswith("spiral") else (3, 5)):
        full, cached, _ = run_distributed(_cached_vs_full, 1, model_kw, loop_kw, "full",
                                          loops)[0]
        assert full.shape == cached.shape
        assert (full - cached).abs().max().item() < 1e-5, (name, loops)


def test_cached_decoding_tp2_equals_tp1():
    model_kw, loop_kw = VARIANTS["prelude+coda+untied+gqa"]
    ref = run_distributed(_cached_vs_full, 1, model_kw, loop_kw, "full", 3)[0]
    for full, cached, _ in run_distributed(_cached_vs_full, 2, model_kw, loop_kw, "full", 3):
        assert (cached - ref[1]).abs().max().item() < 1e-5
        assert (full - cached).abs().max().item() < 1e-5


def test_kv_policies_exact_where_defined():
    """`shared-mod-k` with k = T is `full`; with T = 1 every policy is `full`. `last-step` and
    `first-step` keep one slot: 1/T of `full`'s memory, and they do change the logits."""
    full, cached, full_bytes = run_distributed(_cached_vs_full, 1, {}, {}, "full", 3)[0]
    _, mod3, mod3_bytes = run_distributed(_cached_vs_full, 1, {}, {}, "shared-mod-3", 3)[0]
    assert torch.equal(mod3, cached) and mod3_bytes == full_bytes
    for policy in ("last-step", "first-step", "shared-mod-1"):
        f1, c1, _ = run_distributed(_cached_vs_full, 1, {}, {}, policy, 1)[0]
        assert (f1 - c1).abs().max().item() < 1e-5, policy
        _, approx, nbytes = run_distributed(_cached_vs_full, 1, {}, {}, policy, 3)[0]
        assert nbytes * 3 == full_bytes, policy
        assert (approx[:, :PREFILL] - full[:, :PREFILL]).abs().max().item() < 1e-5  # prefill
        assert (approx[:, PREFILL:] - full[:, PREFILL:]).abs().max().item() > 1e-4, policy


def _generate(rank, world, policy, temperature):
    check_placement()
    from megaloop.inference.generate import Generator, SamplingParams

    setup_parallel(world)
    model = _model({}, {"num_prelude_layers": 1, "input_injection": "scalar-mix"})
    gen = Generator(model, vocab_size=VOCAB - 6, kv_policy=policy, eod=3)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=temperature, top_k=20, top_p=0.9, seed=11)
    return gen.generate(prompts, max_tokens=5, params=params)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_with_and_without_cache_is_identical(temperature):
    cached = run_distributed(_generate, 1, "full", temperature)[0]
    uncached = run_distributed(_generate, 1, "none", temperature)[0]
    assert cached == uncached
    assert all(0 < len(out) <= 5 and max(out) < VOCAB - 6 for out in cached)
    tp2 = run_distributed(_generate, 2, "full", temperature)
    assert tp2[0] == tp2[1] == cached


# --- tools/generate.py on a trained checkpoint ------------------------------------------------
def _train_and_save(rank, world, save):
    check_placement()
    from run_helpers import train
    from test_training import BASE

    return train(BASE + ["--micro-batch-size", "2", "--save", save,
                         "--tensor-model-parallel-size", str(world)])[0]


def _generate_tool(rank, world, argv, out_path):
    check_placement()
    import contextlib
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "generate_tool", os.path.join(root, "megaloop", "cli", "generate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with open(f"{out_path}.{rank}", "w") as f, contextlib.redirect_stdout(f):
        code = tool.main(argv)
    return code, open(f"{out_path}.{rank}").read()


def test_generate_tool_with_and_without_cache(tmp_path):
    """The documented forms: ids in, comma-separated ids out; `--kv-policy none` (recompute
    every token) gives the same greedy output as `full`, and so does a TP=2 launch of a
    checkpoint saved at TP=2 loaded at TP=1 (dist_checkpointing reshards)."""
    ckpt = str(tmp_path / "ckpt")
    assert run_distributed(_train_and_save, 2, ckpt) == [0, 0]
    argv = ["--load", ckpt, "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10",
            "--max-tokens", "12", "--no-stop-at-eod"]
    outs = {}
    for policy in ("full", "none"):
        code, text = run_distributed(_generate_tool, 1, argv + ["--kv-policy", policy],
                                     str(tmp_path / policy))[0]
        assert code == 0
        outs[policy] = text
    lines = outs["full"].strip().split("\n")
    assert len(lines) == 2 and all(len(line.split(",")) == 12 for line in lines)
    assert all(0 <= int(i) < 200 for line in lines for i in line.split(","))
    assert outs["none"] == outs["full"]
    tp2 = run_distributed(_generate_tool, 2, argv, str(tmp_path / "tp2"))
    assert tp2[0] == (0, outs["full"]) and tp2[1] == (0, "")  # rank 0 prints
    bad = run_distributed(_generate_tool, 1, ["--load", ckpt, "--prompt-ids", "5,x"],
                          str(tmp_path / "bad"))[0]
    assert bad[0] == 2


# --- early exit -------------------------------------------------------------------------------
def _sharp_gate(model):
    """A gate with large weights: exit probabilities spread over (0, 1) token by token, so a
    Q-exit threshold sends tokens out at different steps."""
    with torch.no_grad():
        model.exit_gate.linear.weight.mul_(40.0)


def _exit_decode(rank, world, rule_text, loop_kw, one_by_one, model_kw=None):
    check_placement()
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.generate import Generator

    setup_parallel(world)
    model = _model(model_kw or {}, {"num_loops": 4, **loop_kw})
    _sharp_gate(model)
    gen_kw = dict(vocab_size=VOCAB - 6, num_loops=4, kv_policy="full",
                  exit_rule=parse_exit(rule_text))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    if not one_by_one:
        gen = Generator(model, **gen_kw)
        return gen.generate(prompts, max_tokens=8), gen.depths
    outs, depths = [], []
    for p in prompts:  # each row alone: nothing to compact
        gen = Generator(model, **gen_kw)
        outs += gen.generate([p], max_tokens=8)
        depths += gen.depths
    return outs, depths  # (Generator.depths lists row 0's tokens, then row 1's, ...)


@pytest.mark.parametrize("rule", ["q:0.5", "kl:0.5"])
def test_early_exit_batch_equals_rows_alone(rule):
    """Rows that exit leave the batch (carry and caches compacted): a batch decodes exactly as
    each row decoded alone, while tokens exit at different steps. (A larger init makes the
    successive steps' distributions differ enough for the KL rule to spread.)"""
    loop_kw = {"num_coda_layers": 1, "num_prelude_layers": 1} if rule.startswith("q") else {}
    model_kw = {} if rule.startswith("q") else {"init_method_std": 0.3}
    batched, depths = run_distributed(_exit_decode, 1, rule, loop_kw, False, model_kw)[0]
    alone, alone_depths = run_distributed(_exit_decode, 1, rule, loop_kw, True, model_kw)[0]
    assert batched == alone and depths == alone_depths
    assert len(set(depths)) > 1, depths  # compaction really happened


def test_early_exit_that_never_fires_is_plain_decoding():
    plain = run_distributed(_exit_decode, 1, "fixed:4", {}, False)[0]
    never = run_distributed(_exit_decode, 1, "q:1.0", {}, False)[0]
    ref = run_distributed(_exit_decode, 1, None, {}, False)[0]
    assert plain[0] == never[0] == ref[0] and set(plain[1]) == {4}


def _exited_kv_filled(rank, world):
    check_placement()
    from megaloop.inference.early_exit import decode_step, parse_exit, prefill
    from megaloop.inference.kv_cache import LoopKVCache

    setup_parallel(world)
    model = _model({}, {"num_loops": 4, "num_coda_layers": 1, "num_prelude_layers": 1})
    _sharp_gate(model)
    model.eval()
    ids, pos, _ = _batch(4)
    kv = LoopKVCache(4, SEQ)
    prefill(model, ids[:, :PREFILL], pos[:, :PREFILL], kv, 4)
    kv.advance(PREFILL)
    _, depth = decode_step(model, ids[:, PREFILL:PREFILL + 1], pos[:, PREFILL:PREFILL + 1], kv, 4,
                           parse_exit("q:0.5"))
    same = []
    for r, d in enumerate(depth.tolist()):
        for block in ("core", "coda"):
            src = kv.dicts[(block, d)]
            for t in range(d + 1, 5):
                for n in src:
                    same.append(torch.equal(kv.dicts[(block, t)][n][0][PREFILL, r],
                                            src[n][0][PREFILL, r]))
    return depth.tolist(), same


def test_exited_token_kv_is_filled_from_its_exit_step():
    depth, same = run_distributed(_exited_kv_filled, 1)[0]
    assert min(depth) < 4 and same and all(same)


def _first_step_coda(rank, world):
    check_placement()
    from megaloop.inference.kv_cache import LoopKVCache

    setup_parallel(world)
    model = _model({}, {"num_coda_layers": 1})
    model.eval()
    ids, pos, _ = _batch(BATCH)
    caches = {}
    with torch.no_grad():
        for policy in ("full", "first-step"):
            kv = caches[policy] = LoopKVCache(BATCH, SEQ, policy)
            # The coda's buffers start as NaN (megatron-core's are uninitialised): what was not
            # written in the forward stays NaN.
            kv.dicts[("coda", 3 if policy == "full" else 1)] = {
                1: tuple(torch.full((SEQ, BATCH, 4, 8), float("nan"), device=current_device())
                         for _ in range(2))}
            model(ids[:, :PREFILL], pos[:, :PREFILL], None, kv_cache=kv)
    full, first = caches["full"].dicts[("coda", 3)], caches["first-step"].dicts[("coda", 1)]
    return all(torch.equal(full[n][i][:PREFILL], first[n][i][:PREFILL])
               for n in full for i in (0, 1))


def test_first_step_keeps_a_last_step_coda():
    """Without an exit rule the coda runs at step T only, so under first-step its cache keeps
    step T's K/V (those of the full policy's step-T slot), not the memory from before the
    call."""
    assert run_distributed(_first_step_coda, 1)[0]


def _score(rank, world, rule_text):
    check_placement()
    from megaloop.inference.early_exit import parse_exit, score

    setup_parallel(world)
    model = _model({}, {"num_loops": 4})
    _sharp_gate(model)
    model.eval()
    ids, pos, labels = _batch(BATCH)
    with torch.no_grad():
        loss, depth = score(model, ids, pos, labels, 4, parse_exit(rule_text))
        ref = model(ids, pos, None, labels=labels)  # the training forward: every step's loss
    return loss, depth, ref.step_losses, ref.exit_probs


def test_teacher_forced_scoring_under_q_exit():
    """Independent of the decoder: the exit step is the first t whose cumulative p_t from the
    training forward's exit distribution reaches q, the loss that step's training loss."""
    loss, depth, step_losses, probs = run_distributed(_score, 1, "q:0.5")[0]
    cdf = probs.cumsum(0)
    want = torch.where(cdf >= 0.5 - 1e-6, 1, 0).argmax(0) + 1  # first step reaching q
    want = torch.where((cdf >= 0.5 - 1e-6).any(0), want, 4)
    assert torch.equal(depth, want) and len(set(depth.flatten().tolist())) > 1
    picked = step_losses.gather(0, (depth - 1).unsqueeze(0)).squeeze(0)
    assert torch.allclose(loss, picked, atol=1e-5)
    loss_none, depth_none, step_losses, _ = run_distributed(_score, 1, "none")[0]
    assert torch.allclose(loss_none, step_losses[-1], atol=1e-5) and (depth_none == 4).all()


def _row_vs_token(rank, world, rule_text, loop_kw, model_kw):
    """The same rule on the same inputs, per row (decode_step after a prefill of the exact
    context, rows compacted as they exit) and per token (exit_log_probs over the whole sequence,
    masked): exit step and exit-step log-probabilities at every position after the prefill."""
    check_placement()
    from megaloop.inference.early_exit import decode_step, exit_log_probs, parse_exit, prefill
    from megaloop.inference.kv_cache import LoopKVCache
    from megaloop.model.exit_rules import full_vocab_log_probs

    setup_parallel(world)
    model = _model(model_kw, {"num_loops": 4, **loop_kw})
    _sharp_gate(model)
    model.eval()
    rule = parse_exit(rule_text)
    ids, pos, _ = _batch(4)
    with torch.no_grad():
        token_logp, token_depth = exit_log_probs(model, ids, pos, 4, rule, VOCAB)
        rows_logp, rows_depth = [], []
        for j in range(PREFILL, SEQ):  # position j: the context before it prefilled at all steps
            kv = LoopKVCache(4, SEQ)
            prefill(model, ids[:, :j], pos[:, :j], kv, 4)
            kv.advance(j)
            logits, depth = decode_step(model, ids[:, j:j + 1], pos[:, j:j + 1], kv, 4, rule)
            rows_logp.append(full_vocab_log_probs(logits))
            rows_depth.append(depth)
    return (token_logp[:, PREFILL:], token_depth[:, PREFILL:], torch.cat(rows_logp, 1),
            torch.stack(rows_depth, 1))


@pytest.mark.parametrize("rule", ["q:0.5", "kl:0.5"])
def test_exit_rule_per_row_equals_per_token(rule):
    """Decoding (per row: the rows that exit leave the batch) and teacher-forced scoring (per
    token: masked) take the same decisions on the same inputs, while tokens exit at different
    steps."""
    loop_kw = {"num_coda_layers": 1, "num_prelude_layers": 1} if rule.startswith("q") else {}
    model_kw = {} if rule.startswith("q") else {"init_method_std": 0.3}
    token_logp, token_depth, rows_logp, rows_depth = run_distributed(
        _row_vs_token, 1, rule, loop_kw, model_kw)[0]
    assert torch.equal(token_depth, rows_depth), (token_depth, rows_depth)
    assert len(set(rows_depth.flatten().tolist())) > 1, rows_depth
    assert (token_logp - rows_logp).abs().max().item() < 1e-4


def _what_models_support(rank, world):
    check_placement()
    from megaloop.inference.early_exit import parse_exit, score
    from megaloop.inference.generate import Generator

    setup_parallel(world)
    refused = {}

    def refusal(model, **kw):
        try:
            Generator(model, VOCAB - 6, **kw)
        except ValueError as exc:
            return str(exc)
        return None

    spiral = _model({}, {"loop_resolutions": "1/4,1/2,1", "loop_topology": "anchor"})
    _perturb(spiral)
    _sharp_gate(spiral)
    spiral.eval()
    refused["spiral exit"] = refusal(spiral, exit_rule=parse_exit("q:0.5"))
    refused["spiral depth"] = refusal(spiral, num_loops=2)
    refused["spiral plain"] = refusal(spiral)
    dense = _model({}, {"num_loops": 1})  # trained at one step with the expected loss: no gate
    refused["no gate depth"] = refusal(dense, num_loops=2)
    refused["no gate q"] = refusal(dense, exit_rule=parse_exit("q:0.5"))
    refused["no gate kl"] = refusal(dense, exit_rule=parse_exit("kl:0.1"))
    refused["no cache"] = refusal(_model({}, {}), exit_rule=parse_exit("kl:0.1"), kv_policy="none")
    # Teacher-forced scoring under the rule needs no row to leave the batch: SpiralFormer runs it.
    ids, pos, labels = _batch(BATCH)
    with torch.no_grad():
        loss, depth = score(spiral, ids, pos, labels, 3, parse_exit("q:0.5"))
        ref = spiral(ids, pos, None, labels=labels)
    return refused, loss, depth, ref.step_losses, ref.exit_probs


def test_what_a_model_supports_is_refused_by_name():
    """LoopConfig.supports at the generator: SpiralFormer decodes without an exit rule at its own
    schedule's depth only (a row cannot leave its cached chunk latents), and still scores under a
    rule teacher-forced (exit steps from the training forward's exit distribution); a model
    without a gate runs one step and no q-exit; early exit in decoding needs a KV cache."""
    refused, loss, depth, step_losses, probs = run_distributed(_what_models_support, 1)[0]
    assert "--exit q:0.5" in refused["spiral exit"] and "SpiralFormer" in refused["spiral exit"]
    assert "--num-loops 2" in refused["spiral depth"] and "--num-loops 3" in refused["spiral depth"]
    assert refused["spiral plain"] is None and refused["no gate kl"] is None
    assert "--num-loops 2" in refused["no gate depth"]
    assert "no exit gate" in refused["no gate depth"]
    assert "--exit q:0.5" in refused["no gate q"] and "kl:<eps>" in refused["no gate q"]
    assert "--kv-policy full" in refused["no cache"]
    cdf = probs.cumsum(0)
    want = torch.where((cdf >= 0.5 - 1e-6).any(0), (cdf >= 0.5 - 1e-6).int().argmax(0) + 1, 3)
    assert torch.equal(depth, want) and len(set(depth.flatten().tolist())) > 1
    assert torch.allclose(loss, step_losses.gather(0, (depth - 1).unsqueeze(0))[0], atol=1e-5)


# --- a checkpoint trained with FP8, loaded for inference ---------------------------------------
def _fp8_checkpoint(rank, world, save):
    """A checkpoint whose saved run config has --fp8-format hybrid (as a GPU run's with TE)."""
    from megaloop.training import checkpointing
    from megaloop.training.run_config import parse_args
    from test_training import BASE

    check_placement()
    setup_parallel(1)
    cfg = parse_args(BASE)
    run = cfg.to_dict()
    run["model"]["fp8_format"] = "hybrid"
    model = _model({}, {})
    checkpointing.save_checkpoint(save, 1, model, run_config=run)


def _load_fp8(rank, world, load):
    import contextlib
    import io

    from megaloop.inference.loading import load_for_generation

    check_placement()
    setup_parallel(1)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model, _, run = load_for_generation(load)
    return run["model"].get("fp8_format"), getattr(model.config, "fp8", None), err.getvalue()


def test_a_checkpoint_trained_with_fp8_loads_for_inference_without_it(tmp_path):
    """Decoding runs rows x 1 tokens and scoring any width, which FP8 GEMMs refuse: generation,
    serving and evaluation load the weights in their own precision and say so in one line."""
    ckpt = str(tmp_path / "fp8")
    run_distributed(_fp8_checkpoint, 1, ckpt)
    fp8, config_fp8, err = run_distributed(_load_fp8, 1, ckpt)[0]
    assert fp8 is None and not config_fp8
    lines = [line for line in err.splitlines() if "fp8" in line.lower()]
    assert len(lines) == 1 and "--fp8-format hybrid" in lines[0], err
