"""How fast a small transformer learns a reasoning study's task (k steps of a cellular automaton),
outside megaloop (prints, never asserts): held-out accuracy by k every few steps.

    python examples/studies/loop_vs_dense.py --size tiny --output-dir /tmp/s   # builds the data
    python benchmarks/reasoning_sizing.py --data-dir /tmp/s/data/automaton --layers 8 --steps 2000

The model is Hugging Face transformers' Llama (pre-norm RMSNorm, SwiGLU, RoPE, the family every
study arm uses), trained by a plain PyTorch loop on the reasoning studies' own files: the
question/answer pairs (``pairs.jsonl``), their sentencepiece tokenizer and the held-out problems
(``tasks.jsonl``) that ``examples/studies/study.py`` builds. Each problem is one sequence (no
packing), the loss is on the answer tokens, AdamW with warmup and cosine decay as in the studies.
``--loops T`` applies the decoder layers T times (a looped model without exit gate, trained on
its last step). Accuracy is scored as ``megaloop.eval.tasks`` scores it: greedy argmax at every
answer position, teacher-forced.

It answers a sizing question cheaply (one process, no megatron-core): does a model of this depth
leave chance on k = 1, 2, ... within N steps at this batch? If it does not here, a study arm of
the same size will not either.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True,
                   help="a reasoning study's data folder (pairs.jsonl, tokenizer.model, "
                        "tasks.jsonl)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--loops", type=int, default=1, help="apply the layers this many times")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128, help="SwiGLU hidden size")
    p.add_argument("--tied", action="store_true", help="tie the output layer to the embedding")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=100, help="problems per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--max-tasks", type=int, default=480, help="held-out problems scored")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    for name in ("pairs.jsonl", "tokenizer.model", "tasks.jsonl"):
        if not os.path.isfile(os.path.join(args.data_dir, name)):
            p.error(f"--data-dir {args.data_dir}: no {name} (build it with a reasoning study, "
                    f"e.g. examples/studies/loop_vs_dense.py --size tiny)")

    import sentencepiece as spm
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data_dir, "tokenizer.model"))
    eod = sp.eos_id()
    problems = []  # (tokens, loss mask): the answer and the end of document carry the loss
    for line in open(os.path.join(args.data_dir, "pairs.jsonl")):
        row = json.loads(line)
        prompt, answer = sp.encode(row["prompt"]), sp.encode(row["response"]) + [eod]
        problems.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    tasks = [json.loads(line) for line in open(os.path.join(args.data_dir, "tasks.jsonl"))]
    tasks = tasks[: args.max_tasks]
    scored = []
    for t in tasks:
        ids = sp.encode(f"{t['question']} {t['answer']}")
        scored.append((ids, len(sp.encode(t["question"])), t["k"]))

    cfg = LlamaConfig(vocab_size=sp.get_piece_size(), hidden_size=args.hidden,
                      intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=256, tie_word_embeddings=args.tied)
    model = LlamaForCausalLM(cfg)
    if args.loops > 1:  # the same modules T times over
        model.model.layers = torch.nn.ModuleList(list(model.model.layers) * args.loops)
        model.config.num_hidden_layers = args.layers * args.loops
    params = dict(model.named_parameters())  # shared modules appear once
    decay = [q for q in params.values() if q.ndim >= 2]
    no_decay = [q for q in params.values() if q.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step):
        warm = min(1.0, (step + 1) / max(args.warmup, 1))
        t = step / max(args.steps - 1, 1)
        return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def batch():
        rows = [problems[rng.randrange(len(problems))] for _ in range(args.batch)]
        width = max(len(r[0]) for r in rows)
        x = torch.full((len(rows), width), eod)
        m = torch.zeros((len(rows), width))
        for i, (ids, mask) in enumerate(rows):  # right padding: masked, never attended before
            x[i, : len(ids)] = torch.tensor(ids)
            m[i, : len(mask)] = torch.tensor(mask, dtype=torch.float)
        return x, m

    @torch.no_grad()
    def accuracy():
        model.eval()
        hits, counts = {}, {}
        for ids, n, k in scored:
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            ok = all(int(logits[i - 1].argmax()) == ids[i] for i in range(n, len(ids)))
            hits[k] = hits.get(k, 0) + ok
            counts[k] = counts.get(k, 0) + 1
        model.train()
        return {k: hits[k] / counts[k] for k in sorted(counts)}

    print(f"reasoning sizing: {args.layers} layers x {args.loops} loops, hidden {args.hidden}, "
          f"{'tied' if args.tied else 'untied'}, {args.batch} problems per step, LR {args.lr}, "
          f"{len(problems)} training problems, {len(scored)} held-out", flush=True)
    start = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, m = batch()
        logits = model(input_ids=x[:, :-1]).logits
        mask = m[:, 1:]
        loss = (F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
                * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = accuracy()
            print(f"step {step + 1:6d} | {time.time() - start:6.0f} s | loss {loss.item():.4f} | "
                  "accuracy by k " + " ".join(f"k{k} {v:.2f}" for k, v in acc.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
