"""Training parity: megaloop's trainer against an independent one built from Hugging Face
``transformers``' Llama modules and a plain PyTorch loop.

Both start from the same weights (megaloop's initial weights copied into the Llama modules, after
checking them against Megatron's init formula), read the same megatron-core GPTDataset samples in
the order megaloop consumes them (sample ``i * global_batch + j`` at iteration ``i``) and train 20
iterations of AdamW with warmup and cosine decay, gradient clipping and weight decay on the 2-D
weights only. The loss and the gradient norm must agree to 1e-5 at every iteration (fp32, CPU):
this guards the trainer's dynamics (loss averaging, optimizer groups, schedule, clipping, the data
order) the way the looped-vs-unrolled tests guard the forward.

The reference is written from the papers' and Megatron's definitions, not from megaloop's code:
dense is ``LlamaForCausalLM`` itself; looped applies its decoder layers T times with the step norm
between steps (Ouro's recurrent placement: the normalised state enters the next step); the ouro
norm scheme's layer ``u + N2(B(N1 u))`` is written out here. Each "seeded bug" case changes one
thing in the reference (what a trainer with that bug would do) and asserts the comparison catches
it, so the tolerance is shown to be tight enough to matter.
"""

import math

import numpy as np
import pytest
import torch

from distributed import run_distributed
from flags import TEST_FLAGS
from reference import full_params

VOCAB, PADDED = 200, 256  # NullTokenizer ids 0..199, EOD 200; megaloop pads to a multiple of 128
HIDDEN, HEADS, FFN, SEQ, MBS, GBS, ITERS = 32, 4, 128, 32, 2, 4, 20
HP = dict(lr=3e-3, min_lr=3e-4, warmup=4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
          clip=1.0, init_std=0.02)
CASES = {  # name: (physical layers, loops, norm scheme)
    "dense 4, pre-norm": (4, 1, "pre"),
    "loop 2 x 3, pre-norm": (2, 3, "pre"),
    "loop 2 x 3, ouro norm": (2, 3, "ouro"),
}
TOL = 1e-5


def _argv(prefix, layers, loops, scheme):
    return [*TEST_FLAGS,
            "--num-layers", str(layers), "--num-loops", str(loops), "--norm-scheme", scheme,
            "--exit-loss", "last", "--hidden-size", str(HIDDEN), "--num-attention-heads",
            str(HEADS), "--ffn-hidden-size", str(FFN), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MBS),
            "--global-batch-size", str(GBS), "--train-iters", str(ITERS),
            "--lr", str(HP["lr"]), "--min-lr", str(HP["min_lr"]),
            "--lr-warmup-iters", str(HP["warmup"]), "--lr-decay-style", "cosine",
            "--weight-decay", str(HP["weight_decay"]), "--adam-beta1", str(HP["beta1"]),
            "--adam-beta2", str(HP["beta2"]), "--adam-eps", str(HP["eps"]),
            "--clip-grad", str(HP["clip"]), "--init-method-std", str(HP["init_std"]),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--data-path", prefix, "--split", "100,0,0", "--eod-mask-loss",
            "--eval-iters", "0", "--log-interval", "100", "--seed", "5"]


def _write_corpus(prefix):
    """Documents of 5-40 tokens ending in EOD: with --eod-mask-loss every sequence keeps a
    different number of tokens, so per-token and per-sequence averaging differ."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(3)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(300):
        doc = rng.integers(0, VOCAB, size=int(rng.integers(5, 40)))
        builder.add_document(torch.from_numpy(np.append(doc, VOCAB).astype(np.int32)),
                             [len(doc) + 1])
    builder.finalize(prefix + ".idx")
    return True


def _megaloop(rank, world, argv):
    """Initial weights, the samples of every iteration (from the trainer's own GPTDataset, in
    its consumption order), and per iteration the loss and the gradient norm."""
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(argv)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    trainer = Trainer(cfg)
    weights = full_params(trainer.model)
    samples = [{k: torch.as_tensor(v).clone() for k, v in trainer.train_dataset[i].items()}
               for i in range(ITERS * GBS)]
    losses, norms = [], []
    for _ in range(ITERS):
        stats, grad_norm, ok = trainer.train_step()
        assert ok
        losses.append(stats["loss"])
        norms.append(float(grad_norm))
    return weights, samples, losses, norms


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("parity") / "corpus_text_document")
    run_distributed(lambda rank, world: _write_corpus(prefix), 1)
    return {name: run_distributed(_megaloop, 1, _argv(prefix, *shape))[0]
            for name, shape in CASES.items()}


# --- the independent side ----------------------------------------------------------------------
def check_init(weights, layers, bug=None):
    """Megatron's init: N(0, 0.02) for every matrix, 0.02 / sqrt(2 x layers) for the two
    matrices that write into the residual stream (attention output, MLP down projection), norm
    scales 1. The sample std of each matrix (>= 1024 entries: about 2% sampling error) must be
    within 10% of the formula."""
    for name, w in weights.items():
        if w.dim() == 1:
            assert torch.equal(w, torch.ones_like(w)), name
            continue
        std = HP["init_std"]
        if name.endswith(("linear_proj.weight", "linear_fc2.weight")) and bug != "init scaling":
            std /= math.sqrt(2 * layers)
        assert abs(w.std().item() / std - 1) < 0.1, (name, w.std().item(), std)


def llama(weights, layers, scheme):
    """A LlamaForCausalLM holding megaloop's weights, and the ouro scheme's branch norms."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    config = LlamaConfig(vocab_size=PADDED, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         attention_bias=False, mlp_bias=False, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    hd = HIDDEN // HEADS
    state = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"],
             "model.norm.weight": weights["step_norm.weight"]}
    for i in range(layers):
        src, dst = f"core.layers.{i}.", f"model.layers.{i}."
        # Megatron's fused QKV rows: per head, its q, k and v rows (query groups = heads).
        q, k, v = weights[src + "self_attention.linear_qkv.weight"].view(
            HEADS, 3, hd, HIDDEN).unbind(1)
        gate, up = weights[src + "mlp.linear_fc1.weight"].chunk(2)  # SwiGLU: silu(first) * second
        state.update({
            dst + "input_layernorm.weight": weights[src + "input_layernorm.weight"],
            dst + "self_attn.q_proj.weight": q.reshape(HIDDEN, HIDDEN),
            dst + "self_attn.k_proj.weight": k.reshape(HIDDEN, HIDDEN),
            dst + "self_attn.v_proj.weight": v.reshape(HIDDEN, HIDDEN),
            dst + "self_attn.o_proj.weight": weights[src + "self_attention.linear_proj.weight"],
            dst + "post_attention_layernorm.weight": weights[src + "pre_mlp_layernorm.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": weights[src + "mlp.linear_fc2.weight"]})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    branch = torch.nn.ModuleList()
    if scheme == "ouro":
        for i in range(layers):
            pair = torch.nn.ModuleList([LlamaRMSNorm(HIDDEN, eps=1e-5) for _ in range(2)])
            for norm, key in zip(pair, ("self_attn_bda", "mlp_bda")):
                norm.weight.data.copy_(weights[f"core.layers.{i}.{key}.norm.weight"])
            branch.append(pair)
    return model, branch


def logits(model, branch, loops, ids, pos):
    if loops == 1 and not len(branch):
        return model(input_ids=ids, position_ids=pos).logits  # dense: LlamaForCausalLM as is
    m = model.model
    h = m.embed_tokens(ids)
    rope = m.rotary_emb(h, position_ids=pos)
    mask = torch.full((SEQ, SEQ), torch.finfo(h.dtype).min).triu(1)[None, None]
    for _ in range(loops):
        for i, layer in enumerate(m.layers):
            if not len(branch):  # pre-norm: the Llama layer itself
                h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
                continue
            # ouro: u + N2(B(N1 u)) for attention, then for the MLP
            a, _ = layer.self_attn(layer.input_layernorm(h), attention_mask=mask,
                                   position_embeddings=rope, position_ids=pos)
            h = h + branch[i][0](a)
            h = h + branch[i][1](layer.mlp(layer.post_attention_layernorm(h)))
        h = m.norm(h)  # the step norm; its output is the next step's input
    return model.lm_head(h)


def megatron_lr(steps_done, bug=None):
    """Megatron's warmup + cosine decay after ``steps_done`` optimizer steps (the first
    iteration runs at the warmup's lr 0), decayed over --train-iters to --min-lr."""
    lr, low, warm = HP["lr"], HP["min_lr"], HP["warmup"]
    if steps_done <= warm:
        return lr * steps_done / warm
    x = (steps_done - warm) / (ITERS - warm)
    if bug == "schedule":  # linear decay instead of cosine
        return lr - (lr - low) * x
    return low + (lr - low) * 0.5 * (math.cos(math.pi * x) + 1)


def reference(weights, samples, layers, loops, scheme, bug=None):
    """The plain loop: per-token mean loss over the global batch, backward, clip, AdamW."""
    torch.manual_seed(0)
    model, branch = llama(weights, layers, scheme)
    params = list(model.parameters()) + list(branch.parameters())
    decay = [p for p in params if p.dim() > 1 or bug == "weight decay groups"]
    rest = [p for p in params if not any(p is d for d in decay)]
    groups = [{"params": decay, "weight_decay": HP["weight_decay"]}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    losses, norms = [], []
    for it in range(ITERS):
        batch = samples[it * GBS:(it + 1) * GBS]
        ids, labels, mask, pos = (torch.stack([s[k] for s in batch])
                                  for k in ("tokens", "labels", "loss_mask", "position_ids"))
        out = logits(model, branch, loops, ids, pos)
        ce = torch.nn.functional.cross_entropy(out.float().reshape(-1, PADDED),
                                               labels.reshape(-1), reduction="none")
        ce = ce.view_as(mask) * mask
        if bug == "loss averaging":  # each sequence's mean, then the mean of sequences
            loss = (ce.sum(1) / mask.sum(1)).mean()
        else:
            loss = ce.sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, HP["clip"]).item())
        for g in opt.param_groups:
            g["lr"] = megatron_lr(it, bug)
        opt.step()
        losses.append(loss.item())
    return losses, norms


def worst(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_megaloop_trains_like_an_independent_llama_trainer(runs, name):
    layers, loops, scheme = CASES[name]
    weights, samples, losses, norms = runs[name]
    check_init(weights, layers)
    ref_losses, ref_norms = reference(weights, samples, layers, loops, scheme)
    assert losses[-1] < losses[0] - 0.05, losses  # it trains (the comparison is not vacuous)
    assert worst(losses, ref_losses) < TOL, (losses, ref_losses)
    assert worst(norms, ref_norms) < TOL, (norms, ref_norms)


@pytest.mark.parametrize("bug", ["init scaling", "loss averaging", "weight decay groups",
                                 "schedule"])
def test_each_seeded_bug_is_caught(runs, bug):
    """The same comparison with one thing changed on the reference side fails."""
    name = "loop 2 x 3, ouro norm" if bug == "weight decay groups" else "dense 4, pre-norm"
    layers, loops, scheme = CASES[name]
    weights, samples, losses, norms = runs[name]
    if bug == "init scaling":
        with pytest.raises(AssertionError):
            check_init(weights, layers, bug)
        return
    ref_losses, ref_norms = reference(weights, samples, layers, loops, scheme, bug)
    assert max(worst(losses, ref_losses), worst(norms, ref_norms)) > 10 * TOL
