"""A Megatron-LM launch command runs unchanged: flags with Megatron-LM's names have its defaults
and meanings, megaloop's earlier spellings still parse, flags of missing features are refused
by name, the sample-based schedule and batch ramp-up follow Megatron-LM's formulas, and the
README demo still trains the same model as before the defaults changed."""

import math
import re
import shlex
import sys
import types
from pathlib import Path

import numpy
import pytest
import torch

from distributed import run_distributed

ROOT = Path(__file__).resolve().parent.parent

# Megatron-LM core_v0.16.1's defaults (megatron/training/arguments.py, training_config.py,
# common_config.py and megatron-core's TransformerConfig), written out by hand.
MEGATRON_DEFAULTS = {
    "swiglu": False, "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
    "hidden_dropout": 0.1, "attention_dropout": 0.1, "lr_decay_style": "linear",
    "eval_iters": 100, "log_interval": 100, "num_workers": 2, "muon_momentum": 0.9,
    "muon_use_nesterov": False, "muon_num_ns_steps": 5, "muon_scale_mode": "spectral",
    "muon_extra_scale_factor": 1.0, "transformer_impl": "transformer_engine",
    "distributed_backend": "nccl", "distributed_timeout_minutes": 10, "rotary_base": 10000,
    "rotary_percent": 1.0, "make_vocab_size_divisible_by": 128, "init_method_std": 0.02,
    "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
    "clip_grad": 1.0, "min_lr": 0.0, "lr_warmup_iters": 0, "lr_warmup_samples": 0,
    "lr_warmup_fraction": None, "lr_decay_samples": None, "train_samples": None,
    "rampup_batch_size": None, "seed": 1234, "group_query_attention": False,
    "apply_layernorm_1p": False, "norm_epsilon": 1e-5, "rope_scaling_factor": 8.0,
    "fp8_recipe": "delayed", "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent",
    "lr_wsd_decay_style": "exponential", "profile_step_start": 10, "profile_step_end": 12,
    "profile_ranks": [0], "manual_gc": False, "manual_gc_interval": 0,
    "empty_unused_memory_level": 0, "ckpt_format": "torch_dist", "use_checkpoint_args": False,
    "no_save_optim": False, "no_save_rng": False, "grad_reduce_in_bf16": False,
    "decoupled_lr": None, "decoupled_min_lr": None, "no_mmap_bin_files": False,
    "use_distributed_optimizer": False, "overlap_grad_reduce": False,
    "sequence_parallel": False, "untie_embeddings_and_output_weights": False,
    "disable_bias_linear": False,
}


def _flat(cfg) -> dict:
    return {k: v for section in cfg.to_dict().values() for k, v in section.items()}


def test_flags_with_megatron_names_have_megatron_defaults():
    from megaloop.training.run_config import parse_args

    values = _flat(parse_args(["--mock-data"]))
    wrong = {k: (values[k], v) for k, v in MEGATRON_DEFAULTS.items() if values[k] != v}
    assert not wrong, f"flag: (megaloop's default, Megatron-LM's) {wrong}"


def test_megatron_and_megaloop_spellings_parse_alike():
    from megaloop.training.run_config import parse_args

    pairs = [
        (["--muon-use-nesterov"], ["--muon-nesterov"]),
        (["--muon-num-ns-steps", "3"], ["--muon-ns-steps", "3"]),
        (["--muon-scale-mode", "shape_scaling"], ["--muon-scale-mode", "shape"]),
        (["--data-format", "sft"], ["--sft"]),
        (["--tokenizer-type", "SentencePieceTokenizer"],
         ["--tokenizer-type", "GPTSentencePieceTokenizer"]),
    ]
    for a, b in pairs:
        assert _flat(parse_args(["--mock-data"] + a)) == _flat(parse_args(["--mock-data"] + b))
    gqa = parse_args(["--mock-data", "--group-query-attention"]).model
    assert gqa.num_query_groups == 1  # Megatron-LM's --num-query-groups default
    assert parse_args(["--mock-data", "--group-query-attention", "--num-query-groups",
                       "2"]).model.num_query_groups == 2


@pytest.mark.parametrize("argv,fragment", [
    (["--fp16"], "--fp16 is not supported: fp16 training with loss scaling"),
    (["--num-experts", "8"], "--num-experts is not supported: mixture-of-experts"),
    (["--num-layers-per-virtual-pipeline-stage", "2"], "virtual pipeline chunks are its loop"),
    (["--use-legacy-models"], "--use-legacy-models is not supported"),
    (["--moe-router-topk", "2", "--num-layers", "2"], "--moe-router-topk is not supported"),
])
def test_missing_features_refused_by_name(argv, fragment, capsys):
    from megaloop.training.run_config import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--mock-data"] + argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv,fragment", [
    (["--train-samples", "100", "--train-iters", "5"], "--train-samples 100 and --train-iters 5"),
    (["--train-samples", "100", "--lr-decay-iters", "5"], "use --lr-decay-samples"),
    (["--lr-warmup-samples", "5"], "--lr-warmup-samples 5 needs --train-samples"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "pass one of them"),
    (["--rampup-batch-size", "3", "2", "10", "--global-batch-size", "8"],
     "multiple of INCREMENT"),
    (["--rampup-batch-size", "1", "1", "10", "--global-batch-size", "8", "--micro-batch-size",
      "2"], "multiple of --micro-batch-size 2"),
    (["--ckpt-format", "fsdp_dtensor"], "torch_dist"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p needs the Transformer Engine"),
    (["--apply-layernorm-1p", "--normalization", "RMSNorm"], "LayerNorm option"),
])
def test_schedule_and_checkpoint_flag_mistakes_name_the_flag(argv, fragment):
    from megaloop.training.run_config import parse_args

    with pytest.raises(ValueError, match=re.escape(fragment)):
        parse_args(["--mock-data", "--micro-batch-size", "1"] + argv).validate(world_size=1)


# --- Megatron-LM's schedule, written from its documentation ------------------------------------
def megatron_lr(step, warmup, decay, max_lr, min_lr, style):
    """Megatron-LM's OptimizerParamScheduler.get_lr (init LR 0), ``step`` in its unit."""
    if warmup > 0 and step <= warmup:
        return max_lr * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return min_lr + coeff * (max_lr - min_lr)


def ramped_batches(start, increment, ramp, final, train_samples=None, iterations=None):
    """Global batch of every iteration under Megatron-LM's --rampup-batch-size START INCREMENT
    SAMPLES: the batch grows by INCREMENT after every SAMPLES / ((final - START) / INCREMENT)
    consumed samples until SAMPLES; with --train-samples the ramp's iterations then whole final
    batches (update_train_iters)."""
    per_step = ramp / ((final - start) // increment)
    sizes, consumed = [], 0

    def size():
        return final if consumed > ramp else start + increment * math.floor(consumed / per_step)

    if iterations is not None:
        for _ in range(iterations):
            sizes.append(size())
            consumed += sizes[-1]
        return sizes
    while consumed <= ramp and consumed <= train_samples:
        sizes.append(size())
        consumed += sizes[-1]
    sizes += [final] * ((train_samples - consumed) // final)
    return sizes


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2", "--min-lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0"]


def _main(rank, world, flags):
    """pretrain_looplm.main in this rank (the harness's process group is reused)."""
    from run_helpers import main_in_rank

    return main_in_rank(flags)


def _train_records(rank, world, flags):
    import json

    from run_helpers import build_trainer

    build_trainer(flags).train()
    log = flags[flags.index("--log-jsonl") + 1]
    return [json.loads(line) for line in open(log)]


def test_sample_based_schedule_with_rampup_trains_as_megatron(tmp_path):
    """--train-samples with --rampup-batch-size and --lr-warmup-fraction, through the trainer:
    the iterations, the samples each consumes and the LR each applies are Megatron-LM's."""
    log = str(tmp_path / "run.jsonl")
    flags = TINY + ["--num-loops", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
                    "--train-samples", "40", "--rampup-batch-size", "2", "2", "12",
                    "--lr-warmup-fraction", "0.1", "--lr-decay-samples", "36",
                    "--lr-decay-style", "cosine", "--log-jsonl", log]
    records = [r for r in run_distributed(_train_records, 1, flags)[0] if r["split"] == "train"]
    sizes = ramped_batches(2, 2, 12, 8, train_samples=40)
    assert sizes == [2, 2, 4, 6, 8, 8, 8]  # the rule above, spelled out for this case
    assert [r["iteration"] for r in records] == list(range(1, len(sizes) + 1))
    consumed = numpy.cumsum(sizes).tolist()
    assert [r["consumed_samples"] for r in records] == consumed
    for r, before in zip(records, [0] + consumed[:-1]):
        # The LR a step applies is the schedule at the samples consumed before it.
        expect = megatron_lr(before, 0.1 * 36, 36, 1e-2, 1e-3, "cosine")
        assert r["lr"] == pytest.approx(expect, rel=1e-9, abs=1e-15), r["iteration"]


def test_iteration_schedule_with_warmup_fraction_and_ramp_counts_samples(tmp_path):
    """--train-iters with --rampup-batch-size (Megatron-LM's GPT-3 example passes both): the
    schedule counts samples, warmup and decay as --lr-*-iters x the final global batch."""
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import build_scheduler

    cfg = parse_args(TINY + ["--micro-batch-size", "1", "--global-batch-size", "16",
                             "--rampup-batch-size", "4", "4", "40", "--train-iters", "30",
                             "--lr-decay-iters", "25", "--lr-warmup-fraction", "0.2",
                             "--lr-decay-style", "cosine"])
    cfg.validate(world_size=1)
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = build_scheduler(cfg, torch.optim.SGD([param], lr=0.0), dp_size=1)
    sizes = ramped_batches(4, 4, 40, 16, iterations=30)
    consumed = 0
    for it, size in enumerate(sizes):
        assert cfg.training.global_batch_at(consumed, 1) == size, it
        expect = megatron_lr(consumed, 0.2 * 25 * 16, 25 * 16, 1e-2, 1e-3, "cosine")
        assert scheduler.get_lr(scheduler.optimizer.param_groups[0]) == pytest.approx(
            expect, rel=1e-9, abs=1e-15), it
        scheduler.step(increment=size)
        consumed += size


def test_realistic_megatron_command_line(tmp_path, monkeypatch):
    """A Megatron-LM GPT launch line (GQA, RoPE, SwiGLU, RMSNorm, Adam, cosine with a warmup
    fraction, sample-based schedule, batch ramp-up, TP/PP/DP, distributed checkpoints,
    TensorBoard, W&B), written from Megatron-LM's documented flags, plus --num-loops 1: the model
    and schedule are the ones Megatron-LM builds from it."""
    import torch.nn.functional as F

    from megaloop.data.indexed_format import IndexedWriter
    from megaloop.model.config import transformer_config
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import build_scheduler

    # Validation only imports the loggers (not installed here): W&B and TensorBoard stand-ins.
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.ModuleType("torch.utils.tensorboard"))
    for name in ("a", "b"):
        writer = IndexedWriter(str(tmp_path / f"{name}_text_document.bin"), numpy.uint16)
        writer.add_documents(numpy.arange(400), numpy.full(20, 20))
        writer.finalize(str(tmp_path / f"{name}_text_document.idx"))
    (tmp_path / "tokenizer.model").write_text("")
    command = f"""
        --use-mcore-models --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 64
        --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope
        --rotary-base 500000 --rotary-percent 1.0 --swiglu --normalization RMSNorm
        --norm-epsilon 1e-5 --untie-embeddings-and-output-weights --disable-bias-linear
        --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.0134
        --micro-batch-size 1 --global-batch-size 512 --rampup-batch-size 128 128 2000000
        --train-samples 20000000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
        --lr-warmup-fraction 0.01 --lr-decay-samples 19000000 --optimizer adam
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
        --bf16 --calculate-per-token-loss --seed 1234
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2
        --use-distributed-optimizer --overlap-grad-reduce --distributed-timeout-minutes 60
        --data-path 0.7 {tmp_path}/a_text_document 0.3 {tmp_path}/b_text_document
        --split 949,50,1 --tokenizer-type GPTSentencePieceTokenizer
        --tokenizer-model {tmp_path}/tokenizer.model --num-workers 2
        --data-cache-path {tmp_path}/cache --no-mmap-bin-files
        --save {tmp_path}/ckpt --load {tmp_path}/ckpt --save-interval 1000
        --ckpt-format torch_dist --eval-interval 1000 --eval-iters 10 --log-interval 10
        --log-throughput --log-params-norm --tensorboard-dir {tmp_path}/tb
        --log-timers-to-tensorboard --wandb-project looplm --wandb-exp-name gpt-8b
        --num-loops 1"""
    cfg = parse_args(shlex.split(command))
    cfg.validate(world_size=32)  # TP 4 x PP 2 x DP 4
    assert cfg.parallel.data_parallel_size(32) == 4 and cfg.loop.num_loops == 1

    # The block Megatron-LM builds: same sizes, SwiGLU (gated SiLU), RMSNorm, no bias, no dropout.
    tc = transformer_config(cfg.model, cfg.model.num_layers, tp_size=4, bf16=True, cuda=False,
                            te=False)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads,
            tc.num_query_groups, tc.kv_channels) == (16, 2048, 8192, 32, 8, 64)
    assert tc.gated_linear_unit and tc.activation_func is F.silu
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5
    assert not tc.add_bias_linear and tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    assert tc.init_method_std == 0.0134 and tc.bf16
    m = cfg.model
    assert (m.position_embedding_type, m.rotary_base, m.untie_embeddings_and_output_weights) == \
        ("rope", 500000, True)

    # The schedule: iterations from the ramp-up, LR per sample at chosen iterations.
    sizes = ramped_batches(128, 128, 2_000_000, 512, train_samples=20_000_000)
    assert cfg.training.train_iters == len(sizes)
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = build_scheduler(cfg, torch.optim.SGD([param], lr=0.0), dp_size=4)
    consumed, checked = 0, 0
    for it, size in enumerate(sizes):
        if it in (0, 1, 100, 371, 372, 5000, 20000, len(sizes) - 1):
            expect = megatron_lr(consumed, 0.01 * 19_000_000, 19_000_000, 3e-4, 3e-5, "cosine")
            got = scheduler.get_lr(scheduler.optimizer.param_groups[0])
            assert got == pytest.approx(expect, rel=1e-9, abs=1e-15), it
            checked += 1
        assert cfg.training.global_batch_at(consumed, 4) == size
        scheduler.step(increment=size)
        consumed += size
    assert checked == 8


# --- the README demo trains the model it trained before the defaults changed -------------------
FAMILY = {"--swiglu": 0, "--position-embedding-type": 1, "--normalization": 1,
          "--hidden-dropout": 1, "--attention-dropout": 1, "--disable-bias-linear": 0,
          "--num-workers": 1}

# Every flag whose default changed, at megaloop's earlier default (the Muon ones aside: the
# demo trains with Adam).
EARLIER_DEFAULTS = ["--swiglu", "true", "--position-embedding-type", "rope", "--normalization",
                    "RMSNorm", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
                    "--lr-decay-style", "cosine", "--eval-iters", "10", "--log-interval", "10",
                    "--num-workers", "0", "--transformer-impl", "auto", "--distributed-backend",
                    "auto", "--disable-bias-linear", "true"]


def demo_flags() -> list[str]:
    """pretrain_looplm.py's flags in examples/demo_cpu.sh (what the README runs), with the demo
    corpus swapped for mock data of the same vocabulary size, TP=1 and one iteration."""
    text = (ROOT / "examples" / "demo_cpu.sh").read_text()
    body = re.search(r"pretrain_looplm\.py \\\n(.*?)\n(?!\s)", text, re.S).group(1)
    argv = shlex.split(body.replace("\\\n", " ").replace("$OUT", "demo"))
    drop = {"--data-path": 1, "--split": 1, "--tokenizer-type": 1, "--tokenizer-model": 1,
            "--save": 1, "--log-jsonl": 1, "--tensor-model-parallel-size": 1}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in drop:
            i += 1 + drop[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    decay = out[out.index("--train-iters") + 1]
    return out + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
                  "--train-iters", "1", "--lr-decay-iters", decay, "--eval-iters", "0"]


def _without(argv, flags):
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 1 + flags[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def _first_step(rank, world, flags):
    from run_helpers import build_trainer

    trainer = build_trainer(flags)
    cfg = trainer.cfg
    stats, grad_norm, ok = trainer.train_step()
    assert ok
    return cfg.to_dict(), stats["loss"], stats["step_losses"], float(grad_norm)


def test_demo_command_trains_the_same_model_as_before():
    """The demo's flags (Megatron-LM defaults + the model family spelled out) against the
    demo's other flags with every changed default spelled out at its earlier value: the same
    configuration and the same first step, bit for bit."""
    demo = demo_flags()
    assert all(flag in demo for flag in FAMILY), "the demo names its model family"
    spelled = EARLIER_DEFAULTS + _without(demo, FAMILY)
    (cfg_a, loss_a, steps_a, gn_a), = run_distributed(_first_step, 1, demo)
    (cfg_b, loss_b, steps_b, gn_b), = run_distributed(_first_step, 1, spelled)
    for cfg in (cfg_a, cfg_b):  # both resolve to the local spec and gloo on this machine
        cfg["model"].pop("transformer_impl"), cfg["parallel"].pop("distributed_backend")
    assert cfg_a == cfg_b
    assert (loss_a, steps_a, gn_a) == (loss_b, steps_b, gn_b)
    assert cfg_a["model"]["swiglu"] and cfg_a["model"]["normalization"] == "RMSNorm"


# --- GPT2BPETokenizer (--vocab-file / --merge-file) -------------------------------------------
def bytes_to_unicode() -> dict:
    """GPT-2's map of the 256 bytes to printable characters (OpenAI's encoder.py)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return dict(zip(range(256), chars))


class PlainGPT2BPE:
    """GPT-2's encoder written plainly after OpenAI's encoder.py (the algorithm Megatron-LM's
    GPT2BPETokenizer ports): regex pre-tokenization, bytes to symbols, lowest-rank merge first."""

    PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, vocab: dict, merges: list[str]):
        import regex

        self.vocab, self.ranks = vocab, {tuple(m.split()): i for i, m in enumerate(merges)}
        self.bytes = bytes_to_unicode()
        self.pattern = regex.compile(self.PATTERN)

    def bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get(p, math.inf), i) for i, p in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == math.inf:
                break
            first, second = next(p for p in zip(parts, parts[1:]) if self.ranks.get(p) == rank)
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == (first, second):
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            symbols = "".join(self.bytes[b] for b in piece.encode("utf-8"))
            ids += [self.vocab[t] for t in self.bpe(symbols)]
        return ids


MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d", "o o", "l o", "lo o", "loo p",
          "e e", "ee e"]


def write_gpt2_files(folder: Path) -> tuple[str, str, dict]:
    """A tiny GPT-2-format vocab.json / merges.txt: the 256 byte symbols, a few merges, EOD."""
    import json

    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    for merge in MERGES:
        vocab["".join(merge.split())] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return str(folder / "vocab.json"), str(folder / "merges.txt"), vocab


def test_gpt2_bpe_tokenizer_matches_plain_gpt2_encoder(tmp_path):
    """megaloop's GPT2BPETokenizer (the ``tokenizers`` library) against GPT-2's encoder written
    out above, on the files the test writes."""
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.tokenizers import build_tokenizer

    vocab_file, merges_file, vocab = write_gpt2_files(tmp_path)
    ours = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer",
                                           vocab_file=vocab_file, merge_file=merges_file))
    ref = PlainGPT2BPE(vocab, MERGES)
    texts = ["the loop and the loop", " the  in\tand\n\nloopy", "Ünïcödé — 123 don't",
             "theloop eeee", ""]
    for text in texts:
        ids = ours.tokenize(text)
        assert ids == ref.encode(text), text
        assert ours.detokenize(ids) == text
    assert any(len(ours.tokenize(t)) < len(t.encode()) for t in texts)  # merges applied
    assert ours.tokenize_batch(texts) == [ref.encode(t) for t in texts]
    assert ours.eod == vocab["<|endoftext|>"] and ours.vocab_size == len(vocab)


def test_gpt2_bpe_flags(tmp_path):
    from megaloop.training.run_config import parse_args

    vocab, merges, _ = write_gpt2_files(tmp_path)
    with pytest.raises(ValueError, match="add it, or drop them"):
        parse_args(["--mock-data", "--vocab-file", vocab, "--merge-file", merges,
                    "--vocab-size", "8"]).validate(world_size=1)
    with pytest.raises(ValueError, match="needs --merge-file"):
        parse_args(["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                    vocab]).validate(world_size=1)
    cfg = parse_args(["--mock-data", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                      vocab, "--merge-file", merges])
    cfg.validate(world_size=1)


# --- features behind the new flags ---------------------------------------------------------------
BASE2 = TINY + ["--num-loops", "2", "--swiglu", "--position-embedding-type", "rope",
                "--normalization", "RMSNorm", "--disable-bias-linear", "--adam-eps", "1e-4"]


def _two_steps(rank, world, flags):
    from megaloop.training.step_hooks import params_norm
    from reference import full_params
    from run_helpers import build_trainer

    trainer = build_trainer(flags)
    losses = [trainer.train_step()[0]["loss"] for _ in range(3)]
    trainer.sync_params()
    return losses, full_params(trainer.model), params_norm(trainer.model)


def test_overlap_param_gather_dp2_equals_dp1_and_params_norm():
    """--overlap-param-gather (the weights gathered during the next forward): DP=2 with the
    distributed optimizer gives the single rank's losses and weights; the parameter norm equals
    the norm of the full weights computed here, at TP=2 too."""
    one = run_distributed(_two_steps, 1, BASE2 + ["--micro-batch-size", "2",
                                                  "--global-batch-size", "2"])[0]
    dp2 = run_distributed(_two_steps, 2, BASE2 + [
        "--micro-batch-size", "1", "--global-batch-size", "2", "--use-distributed-optimizer",
        "--overlap-param-gather"])
    tp2 = run_distributed(_two_steps, 2, BASE2 + [
        "--micro-batch-size", "2", "--global-batch-size", "2", "--tensor-model-parallel-size",
        "2"])
    ref_norm = math.sqrt(sum(float(p.double().pow(2).sum()) for p in one[1].values()))
    assert one[2] == pytest.approx(ref_norm, rel=1e-9)
    for losses, params, norm in dp2 + tp2:
        assert losses == pytest.approx(one[0], abs=2e-5)
        assert params.keys() == one[1].keys()
        for k in params:
            assert torch.allclose(params[k], one[1][k], atol=1e-5, rtol=1e-4), k
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_no_save_optim_and_rng_and_checkpoint_args(tmp_path):
    """--no-save-optim / --no-save-rng leave those parts out (a resume starts them afresh and
    says so); --use-checkpoint-args takes the architecture from the checkpoint."""
    import json

    from megaloop.checkpoint.format import read_common
    from megaloop.training import checkpointing
    from megaloop.training.run_config import parse_args

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    flags = BASE2 + ["--micro-batch-size", "2", "--train-iters", "2", "--save", ckpt,
                     "--no-save-optim", "--no-save-rng", "--log-jsonl", log]
    run_distributed(_train_records, 1, flags)
    path = checkpointing.checkpoint_dir(ckpt, 2)
    common = read_common(path)
    assert not common["has_optimizer"] and not common["has_rng"]
    assert "opt_param_scheduler" not in common
    # A different architecture on the command line: taken from the checkpoint instead.
    cfg = parse_args(TINY + ["--load", ckpt, "--use-checkpoint-args", "--hidden-size", "64"])
    changed = checkpointing.apply_checkpoint_args(cfg)
    assert cfg.model.hidden_size == 32 and cfg.model.swiglu  # (the loop count may change)
    assert "--hidden-size 32" in changed and "--swiglu True" in changed
    resumed = str(tmp_path / "b.jsonl")
    assert run_distributed(_main, 1, TINY + [
        "--load", ckpt, "--use-checkpoint-args", "--hidden-size", "64", "--train-iters", "3",
        "--micro-batch-size", "2", "--log-jsonl", resumed])[0] == 0
    records = [json.loads(line) for line in open(resumed)]
    assert [r["iteration"] for r in records if r["split"] == "train"] == [3]
    assert json.loads(open(log).readline())["iteration"] == 1


def _gc_state_during_and_after_training(rank, world, flags):
    """Whether automatic collection was on at every step, and after train() returned."""
    import gc

    from run_helpers import build_trainer

    trainer = build_trainer(flags)
    during, step = [], trainer.train_step

    def train_step():
        during.append(gc.isenabled())
        return step()

    trainer.train_step = train_step
    trainer.train()
    return during, gc.isenabled()


def test_profile_and_manual_gc(tmp_path):
    """--profile writes a Chrome trace of the profiled iterations (next to --save without a
    TensorBoard folder); --manual-gc turns automatic collection off for the run, and back on
    when the run ends."""
    import json

    ckpt = str(tmp_path / "ckpt")
    gc_enabled = run_distributed(_gc_state_during_and_after_training, 1, BASE2 + [
        "--micro-batch-size", "2", "--train-iters", "4", "--profile", "--profile-step-start", "1",
        "--profile-step-end", "3", "--manual-gc", "--manual-gc-interval", "2", "--save", ckpt,
        "--log-jsonl", str(tmp_path / "log.jsonl")])
    during, after = gc_enabled[0]
    assert during[1:] == [False] * 3 and after  # off from the first step's end on
    trace = Path(ckpt) / "profile" / "trace_rank0_iters2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name")) for e in events)


# --- Megatron-LM's own example launch scripts (core_v0.16.1), shrunk, on CPU ---------------------
# examples/gpt3/train_gpt3_175b_distributed.sh: the flags as the script writes them, sizes shrunk
# (96 -> 2 layers, hidden 12288 -> 64, 96 -> 4 heads, sequence 2048 -> 64, global batch 1536 ->
# 8 with the ramp 16 16 5859375 -> 2 2 8, 500000 -> 6 iterations, decay 430000 -> 5, TP 8 x PP 16
# -> TP 2). Set aside: --fp16 (megaloop refuses it: no loss scaling) and --tensorboard-dir
# (tensorboard is not installed on this machine). Added: --tokenizer-type GPT2BPETokenizer, which
# the script omits (Megatron-LM's build_tokenizer needs it too), and --num-loops 2.
GPT3_175B = """
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64 --attention-backend auto
    --micro-batch-size 1 --global-batch-size 8 --rampup-batch-size 2 2 8 --train-iters 6
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
    --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001
    --lr-decay-iters 5
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    --data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
    --log-interval 1 --save-interval 6 --eval-interval 3 --save {ckpt} --load {ckpt}
    --eval-iters 2
    --tokenizer-type GPT2BPETokenizer --num-loops 2 --log-jsonl {log}"""

# examples/llama/train_llama3_8b_h100_fp8.sh, its mock-data branch: sizes shrunk (32 -> 2
# layers, hidden 4096 -> 64, FFN 14336 -> 224, 32 -> 4 heads, 8 -> 2 groups, head 128 -> 16,
# sequence 8192 -> 64, global batch 128 -> 4, samples 1953125000 / 1949218748 / 3906252 -> 24 /
# 20 / 4, vocabulary 128256 -> 512, 8 -> 2 ranks (DP 2), eval iterations 32 -> 2, profile steps
# 4-6 -> 2-3). Set aside, GPU-only: the FP8 flags (--fp8-format hybrid --fp8-amax-history-len
# 1024 --fp8-amax-compute-algo max --fp8-param-gather), --attention-backend fused and
# --apply-layernorm-1p (Transformer Engine kernels); --tensorboard-dir (not installed here).
# --split '99,1,0' is passed as 99,1,0 (inside the script's quoted array entry the quotes reach
# the program literally). Added: --num-loops 2.
LLAMA3_8B = """
    --use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224
    --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16
    --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
    --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
    --swiglu --init-method-std 0.0134 --untie-embeddings-and-output-weights --disable-bias-linear
    --micro-batch-size 1 --global-batch-size 4 --train-samples 24 --lr-decay-samples 20
    --lr-warmup-samples 4 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
    --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
    --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --data-cache-path {cache}
    --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files --num-workers 1
    --log-interval 1 --eval-iters 2 --eval-interval 100 --save-interval 1000 --log-throughput
    --profile --profile-step-start 2 --profile-step-end 3 --ckpt-format torch_dist
    --distributed-timeout-minutes 60 --save {ckpt} --load {ckpt}
    --num-loops 2 --log-jsonl {log}"""


def _train_log(log):
    import json

    return [json.loads(line) for line in open(log)]


def test_megatron_gpt3_example_trains_on_cpu(tmp_path):
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.indexed_format import IndexedWriter
    from megaloop.data.tokenizers import build_tokenizer

    vocab, merges, _ = write_gpt2_files(tmp_path)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                                          merge_file=merges))
    rng = numpy.random.default_rng(0)
    words = ["the", "loop", "and", "in", "a", "see", "looped", "then"]
    writer = IndexedWriter(str(tmp_path / "corpus_text_document.bin"), numpy.uint16)
    for _ in range(200):
        ids = tok.tokenize(" ".join(rng.choice(words, size=40))) + [tok.eod]
        writer.add_documents(numpy.array(ids), numpy.array([len(ids)]))
    writer.finalize(str(tmp_path / "corpus_text_document.idx"))
    log = tmp_path / "log.jsonl"
    flags = shlex.split(GPT3_175B.format(
        data=tmp_path / "corpus_text_document", vocab=vocab, merges=merges,
        ckpt=tmp_path / "ckpt", log=log))
    assert run_distributed(_main, 2, flags, timeout=300) == [0, 0]
    train = [r for r in _train_log(log) if r["split"] == "train"]
    assert [r["consumed_samples"] for r in train] == \
        numpy.cumsum(ramped_batches(2, 2, 8, 8, iterations=6)).tolist()
    assert all(len(r["step_losses"]) == 2 and math.isfinite(r["loss"]) for r in train)
    assert any(r["split"] == "valid" for r in _train_log(log))
    assert (tmp_path / "ckpt" / "iter_0000006").is_dir()


def test_megatron_llama3_example_trains_on_cpu(tmp_path):
    log = tmp_path / "log.jsonl"
    flags = shlex.split(LLAMA3_8B.format(cache=tmp_path / "cache", ckpt=tmp_path / "ckpt",
                                         log=log))
    assert run_distributed(_main, 2, flags, timeout=300) == [0, 0]
    train = [r for r in _train_log(log) if r["split"] == "train"]
    assert [r["iteration"] for r in train] == list(range(1, 7))  # 24 samples / 4
    assert all(math.isfinite(r["loss"]) for r in train)
    # sample-based warmup over 4 samples = the first global batch; then cosine over 20 samples
    assert train[0]["lr"] == 0.0 and train[1]["lr"] == pytest.approx(1.5e-4, rel=1e-6)
    assert (tmp_path / "ckpt" / "profile" / "trace_rank0_iters3-3.json").is_file()


def test_rampup_with_the_looped_pipeline_needs_whole_micro_batch_groups():
    from megaloop.training.run_config import parse_args

    flags = TINY + ["--num-loops", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
                    "--pipeline-model-parallel-size", "2", "--train-iters", "4"]
    with pytest.raises(ValueError, match="ramped global batch 1 gives"):
        parse_args(flags + ["--rampup-batch-size", "1", "1", "8"]).validate(world_size=2)
    parse_args(flags + ["--rampup-batch-size", "2", "2", "8"]).validate(world_size=2)


def test_data_args_files_give_the_blends(tmp_path):
    """--data-args-path / --per-split-data-args-path: the same blends as the flags they hold."""
    import json

    from megaloop.data.indexed_format import IndexedWriter
    from megaloop.training.run_config import parse_args

    for name in ("a", "b"):
        writer = IndexedWriter(str(tmp_path / f"{name}.bin"), numpy.uint16)
        writer.add_documents(numpy.arange(400), numpy.full(20, 20))
        writer.finalize(str(tmp_path / f"{name}.idx"))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    (tmp_path / "blend.txt").write_text(f"0.3 {a}\n0.7 {b}\n")
    (tmp_path / "splits.json").write_text(json.dumps({"train": f"1 {a} 2 {b}", "valid": [b]}))
    base = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--num-workers", "0"]
    cfgs = [parse_args(base + flags) for flags in (
        ["--data-args-path", str(tmp_path / "blend.txt")], ["--data-path", "0.3", a, "0.7", b],
        ["--per-split-data-args-path", str(tmp_path / "splits.json")],
        ["--train-data-path", "1", a, "2", b, "--valid-data-path", b])]
    for cfg in cfgs:
        cfg.validate(world_size=1)
    assert cfgs[0].data.blends() == cfgs[1].data.blends() == [([a, b], [0.3, 0.7])]
    assert cfgs[2].data.blends() == cfgs[3].data.blends() == [([a, b], [1.0, 2.0]), ([b], None),
                                                              None]
    with pytest.raises(ValueError, match="--data-args-path replaces --data-path"):
        parse_args(base + ["--data-args-path", str(tmp_path / "blend.txt"), "--data-path",
                           a]).validate(world_size=1)


def test_sample_based_config_validates_again_as_saved():
    """A --train-samples run's saved config (train_iters resolved) validates again unchanged."""
    import dataclasses

    from megaloop.training.run_config import RunConfig, parse_args

    cfg = parse_args(TINY + ["--micro-batch-size", "2", "--global-batch-size", "8",
                             "--train-samples", "40", "--rampup-batch-size", "2", "2", "12"])
    cfg.validate(world_size=1)
    assert cfg.training.train_iters == 7
    again = RunConfig(**{f.name: type(getattr(cfg, f.name))(**section)
                         for f, section in zip(dataclasses.fields(cfg), cfg.to_dict().values())})
    again.validate(world_size=1)
    assert again.training.train_iters == 7


def test_tools_accept_megatron_tokenizer_name(tmp_path):
    """tools/preprocess_data.py and tools/generate.py take GPTSentencePieceTokenizer as the
    sentencepiece tokenizer, as pretrain_looplm.py does."""
    import subprocess

    for tool, args in (("preprocess_data.py", ["--input", str(tmp_path / "none.jsonl"),
                                                "--output-prefix", str(tmp_path / "o")]),
                       ("generate.py", ["--load", str(tmp_path / "none"), "--prompt", "x"])):
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args,
                               "--tokenizer-type", "GPTSentencePieceTokenizer"],
                              capture_output=True, text=True, timeout=120)
        # Parsed: the run stops at the missing input, not at the tokenizer's name.
        assert "invalid choice" not in proc.stderr and "none" in proc.stderr, proc.stderr
