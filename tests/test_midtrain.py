"""The mid-training recipe (examples/recipes/looplm_1.4b_midtrain.sh), its printed flags with tiny
iteration counts, after a tiny run of the pretraining recipe it continues:

- the mid-training run starts from the pretraining checkpoint's weights: its first loss equals
  the loss of the checkpoint's model, loaded here by megaloop.checkpoint.load, on that batch;
- the LR follows the new schedule (re-warmed from 0, then cosine), against the formula;
- the loss is on response tokens only: the batch's loss mask equals the one derived here from
  the examples' layout, changing a prompt position's label leaves the loss as it is, changing a
  response position's label changes it.

The instruction data repeats one example, so the packed stream is periodic (prompt, response,
EOD, prompt, ...) and which token of a sample is a response token follows from where its EODs
are, without the dataset code.
"""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
PROMPT, RESPONSE = "x=7. y=x. what is y?", "answer: 7."
ITERS, WARMUP = 5, 3


def recipe_flags(script: str, data: str, tokenizer: str, env: dict, extra: list) -> list[str]:
    env = {**os.environ, "SIZE": "cpu", "PRINT_ARGS": "1", **env}
    out = subprocess.run(["bash", str(RECIPES / script), data, tokenizer, *extra], env=env,
                         check=True, capture_output=True, text=True).stdout
    return out.splitlines()


def _train(rank, world, flags):
    from megaloop.parallel.initialize import initialize
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(flags)
    cfg.validate(world_size=world)
    initialize(cfg.parallel, cfg.training.seed)
    Trainer(cfg).train()
    with open(cfg.logging.log_jsonl) as f:
        return [json.loads(line) for line in f]


def _midtrain(rank, world, flags, ckpt, response_len, period):
    """The mid-training run's records; then, on its first batch, the loss of the checkpoint's
    model (loaded here, and of a fresh one), the batch's mask against the periodic layout, and
    the loss with changed labels."""
    from megaloop.checkpoint.load import load_model
    from megaloop.data.datasets import build_data_iterator, build_train_valid_test_datasets
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.model.looped_gpt import build_model
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import forward_step

    records = _train(rank, world, flags)
    cfg = parse_args(flags)
    tr = cfg.training
    tokenizer = build_tokenizer(cfg.tokenizer)
    train, _, _ = build_train_valid_test_datasets(
        cfg.data, tokenizer, tr.seq_length, tr.seed, (tr.train_iters * tr.global_batch_size, 0, 0))
    batch = next(build_data_iterator(train, 0, tr.micro_batch_size, 0, 1))

    # The loss mask from the layout: a label (the next token) is a response token or the EOD
    # closing it when it lies 0..response_len tokens before an EOD, in the periodic stream.
    tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], 1)
    want_mask = torch.zeros_like(batch["loss_mask"])
    for b in range(tokens.shape[0]):
        eod = (tokens[b] == tokenizer.eod).nonzero()[0].item()
        for i in range(tokens.shape[1] - 1):
            want_mask[b, i] = float((eod - (i + 1)) % period <= response_len)
    assert 0 < want_mask.mean() < 1

    def loss(model, batch):
        out, finish = forward_step(iter([batch]), model, cfg.loop.num_loops)
        total, count, _ = finish(out)
        return (total / count).item()

    model = load_model(ckpt)[0].eval()
    fresh = build_model(cfg.model, cfg.loop, model.vocab_size).eval()
    with torch.no_grad():
        losses = {"checkpoint": loss(model, batch), "fresh": loss(fresh, batch),
                  "no mask": loss(model, {**batch, "loss_mask": torch.ones_like(want_mask)})}
        for name, where in (("prompt label changed", 0.0), ("response label changed", 1.0)):
            labels = batch["labels"].clone()
            at = (want_mask == where).nonzero()[0]
            labels[at[0], at[1]] = (labels[at[0], at[1]] + 1) % tokenizer.vocab_size
            losses[name] = loss(model, {**batch, "labels": labels})
    return records, losses, bool(torch.equal(batch["loss_mask"], want_mask))


@pytest.fixture(scope="module")
def midtrain(tmp_path_factory):
    from megaloop.data.config import TokenizerConfig
    from megaloop.data.preprocess import preprocess
    from megaloop.data.tokenizers import build_tokenizer, train_sentencepiece
    from test_data_demo_corpus import load_tool

    d = tmp_path_factory.mktemp("midtrain")
    load_tool().main(["--output", str(d / "corpus.jsonl"), "--num-docs", "300", "--seed", "1"])
    texts = [json.loads(line)["text"] for line in open(d / "corpus.jsonl")]
    sp = train_sentencepiece(texts, str(d / "tok"), vocab_size=512)
    tok_cfg = TokenizerConfig("SentencePieceTokenizer", sp)
    preprocess(str(d / "corpus.jsonl"), str(d / "corpus"), tok_cfg, append_eod=True, workers=0,
               progress=False)
    with open(d / "sft.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"prompt": PROMPT, "response": RESPONSE}) + "\n")
    preprocess(str(d / "sft.jsonl"), str(d / "sft"), tok_cfg, data_format="sft", workers=0,
               progress=False)
    tokenizer = build_tokenizer(tok_cfg)
    prompt_len, response_len = len(tokenizer.tokenize(PROMPT)), len(tokenizer.tokenize(RESPONSE))

    ckpt, save = str(d / "pretrained"), str(d / "midtrained")
    quick = ["--eval-iters", "0", "--log-interval", "1"]
    # A few pretraining steps at full LR, so that its weights differ from the initial ones.
    pre = recipe_flags("looplm_1.4b.sh", str(d / "corpus_text_document"), sp, {"SAVE_DIR": ckpt},
                       ["--train-iters", "3", "--lr-warmup-iters", "1", *quick,
                        "--log-jsonl", str(d / "pre.jsonl")])
    run_distributed(_train, 1, pre)
    mid = recipe_flags("looplm_1.4b_midtrain.sh", str(d / "sft_text_document"), sp,
                       {"PRETRAINED": ckpt, "SAVE_DIR": save},
                       ["--train-iters", str(ITERS), *quick, "--log-jsonl", str(d / "mid.jsonl")])
    records, losses, mask_ok = run_distributed(_midtrain, 1, mid, ckpt, response_len,
                                               prompt_len + response_len + 1)[0]
    return mid, [r for r in records if r["split"] == "train"], losses, mask_ok


def test_the_recipe_continues_the_pretraining_checkpoint_on_sft_data(midtrain):
    from megaloop.training.run_config import parse_args

    flags, records, losses, _ = midtrain
    cfg = parse_args(flags)
    # The first step's loss is the checkpoint's on that batch (not a fresh model's).
    assert records[0]["loss"] == pytest.approx(losses["checkpoint"], abs=1e-5)
    assert abs(losses["fresh"] - losses["checkpoint"]) > 0.05
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert records[0]["consumed_samples"] == cfg.training.global_batch_size  # a new data position
    assert cfg.data.data_format == "sft" and cfg.checkpoint.finetune
    assert (cfg.loop.num_loops, cfg.model.norm_scheme, cfg.loop.exit_kl_beta) == (4, "ouro", 0.15)


def test_the_lr_is_rewarmed_and_follows_the_new_schedule(midtrain):
    from megaloop.training.run_config import parse_args

    flags, records, _, _ = midtrain
    opt = parse_args(flags).optim
    assert opt.lr_warmup_iters == WARMUP and opt.lr_decay_style == "cosine"
    for r in records:
        n = r["iteration"] - 1  # scheduler steps taken before this iteration's update
        if n <= WARMUP:
            want = opt.lr * n / WARMUP
        else:
            ratio = (n - WARMUP) / (ITERS - WARMUP)
            want = opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1)
        assert r["lr"] == pytest.approx(want, rel=1e-6, abs=1e-12), r["iteration"]


def test_the_loss_is_on_response_tokens_only(midtrain):
    _, records, losses, mask_ok = midtrain
    assert mask_ok  # the batch's mask is the layout's: response tokens and their EOD
    assert losses["prompt label changed"] == losses["checkpoint"]
    assert abs(losses["response label changed"] - losses["checkpoint"]) > 1e-4
    assert abs(losses["no mask"] - records[0]["loss"]) > 1e-3
