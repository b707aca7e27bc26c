"""Decoding speed, KV memory and quality of KV policies and early-exit rules (prints, never
asserts).

    bash examples/demo_cpu.sh            # trains the demo model and saves demo/checkpoint
    python benchmarks/decode.py [--load demo/checkpoint --data-path demo/corpus_text_document]

Quality is measured the way decoding sees the text: held-out windows (the last documents of the
dataset, the validation split of the demo run) are teacher-forced through the decoder itself, a
prefill of the first half and then one token at a time with the KV policy and exit rule under
test, and the loss of the second half's next-token predictions is averaged. So a policy's
approximate cache and an exit rule's filled-in K/V count, not only the exit step's readout.

For each exit rule (Q-exit, Huginn's KL, a fixed depth) the most aggressive threshold of a small
grid whose held-out loss is within --max-loss-increase (1%) of full depth is kept. Speed: a batch
of prompts, greedy, --max-tokens each (no stop at EOD, so every configuration decodes the same
number of tokens); prefill ms of the first forward, decode tokens/s of the rest, KV bytes.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megaloop.runtime import quiet_megatron  # noqa: E402

quiet_megatron()

import torch  # noqa: E402

Q_GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
KL_GRID = (3e-1, 1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4)


@torch.no_grad()
def decode_loss(model, windows, num_loops, policy, rule):
    """Mean next-token loss of the second half of ``windows`` [n, L], decoded one token at a
    time after a prefill of the first half; and the mean executed depth of those tokens."""
    from megatron.core import tensor_parallel

    from megaloop.inference import early_exit
    from megaloop.inference.kv_cache import LoopKVCache

    n, L = windows.shape
    half = L // 2
    kv = LoopKVCache(n, L, policy)
    pos = torch.arange(L).expand(n, L)
    if rule is None:
        logits = model(windows[:, :half], pos[:, :half], None, num_loops=num_loops, kv_cache=kv)
    else:
        logits = early_exit.prefill(model, windows[:, :half], pos[:, :half], kv, num_loops)
    kv.advance(half)
    losses, depths = [], []
    for j in range(half, L - 1):
        ids, p = windows[:, j:j + 1], pos[:, j:j + 1]
        if rule is None:
            logits = model(ids, p, None, num_loops=num_loops, kv_cache=kv)
            depths.append(torch.full((n,), num_loops))
        else:
            logits, depth = early_exit.decode_step(model, ids, p, kv, num_loops, rule)
            depths.append(depth)
        kv.advance(1)
        logp = torch.log_softmax(
            tensor_parallel.gather_from_tensor_model_parallel_region(logits[:, -1]).float(), -1)
        losses.append(-logp.gather(-1, windows[:, j + 1:j + 2]).squeeze(-1))
    return torch.stack(losses).mean().item(), torch.stack(depths).float().mean().item()


def speed(model, vocab, prompts, num_loops, policy, rule, max_tokens):
    from megaloop.inference.generate import Generator

    gen = Generator(model, vocab, num_loops=num_loops, kv_policy=policy, exit_rule=rule)
    gen.generate(prompts[:2], max_tokens=4)  # warm-up: allocator, first-touch
    gen.depths = []
    gen.generate(prompts, max_tokens=max_tokens)
    s = gen.stats
    tokens = len(prompts) * s["decode_forwards"]
    depth = sum(gen.depths) / len(gen.depths) if gen.depths else float(num_loops)
    return s["prefill_s"] * 1e3, tokens / s["decode_s"], s["kv_bytes"], depth


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", default="demo/checkpoint")
    p.add_argument("--data-path", default="demo/corpus_text_document")
    p.add_argument("--num-loops", type=int, default=None, help="default: the trained T")
    p.add_argument("--windows", type=int, default=8, help="held-out windows (quality)")
    p.add_argument("--window-length", type=int, default=96)
    p.add_argument("--prompts", type=int, default=8, help="batch of prompts (speed)")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-loss-increase", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if not os.path.isdir(a.load):
        sys.exit(f"--load {a.load}: no checkpoint there; run `bash examples/demo_cpu.sh` first")
    from megaloop.data.heldout import validation_windows
    from megaloop.inference.early_exit import parse_exit
    from megaloop.inference.loading import load_for_generation, setup_processes

    torch.set_num_threads(a.threads)
    setup_processes()
    model, tokenizer, run = load_for_generation(a.load)
    T = a.num_loops or model.loop.num_loops
    data = torch.from_numpy(validation_windows(
        a.data_path, a.windows + a.prompts, max(a.window_length, a.prompt_length)))
    windows = data[:a.windows, :a.window_length]
    prompts = data[a.windows:, :a.prompt_length].tolist()

    base, _ = decode_loss(model, windows, T, "full", None)
    chosen = {}
    grids = {"q": [f"q:{q}" for q in Q_GRID], "kl": [f"kl:{e:g}" for e in KL_GRID],
             "fixed": [f"fixed:{n}" for n in range(1, T)]}
    print(f"held-out loss at full depth T={T}: {base:.4f}; exit-rule sweep (loss, mean depth):")
    for kind, grid in grids.items():
        for text in grid:
            loss, depth = decode_loss(model, windows, T, "full", parse_exit(text))
            ok = loss <= base * (1 + a.max_loss_increase)
            print(f"  {text:10s} loss {loss:.4f} ({loss / base - 1:+.2%})  depth {depth:.2f}"
                  f"{'' if ok else '  (over budget)'}", flush=True)
            if ok and (kind not in chosen or depth < chosen[kind][2]):
                chosen[kind] = (text, loss, depth)

    rows = [("full-T, no exit", "full", None), ("no cache (recompute)", "none", None)]
    rows += [(f"kv {pol}", pol, None) for pol in ("last-step", "first-step", "shared-mod-2")]
    rows += [(f"exit {c[0]}", "full", c[0]) for c in chosen.values()]
    print(f"\ndecode: {len(prompts)} prompts x {a.prompt_length} tokens, {a.max_tokens} new "
          f"tokens each, greedy, {a.threads} thread(s); checkpoint {a.load}")
    print(f"{'configuration':22s} {'prefill ms':>10s} {'decode tok/s':>12s} {'KV MiB':>7s} "
          f"{'depth':>6s} {'held-out loss':>13s} {'vs full':>8s}")
    results = {}
    for label, policy, rule_text in rows:
        rule = parse_exit(rule_text)
        pre, tps, kv_bytes, depth = speed(model, tokenizer.vocab_size, prompts, T, policy, rule,
                                          a.max_tokens)
        loss = base if policy in ("full", "none") and rule is None else \
            decode_loss(model, windows, T, policy, rule)[0]
        results[label] = tps
        print(f"{label:22s} {pre:10.1f} {tps:12.1f} {kv_bytes / 2**20:7.2f} {depth:6.2f} "
              f"{loss:13.4f} {loss / base - 1:+8.2%}", flush=True)
    full = results["full-T, no exit"]
    for label, tps in results.items():
        if label.startswith("exit"):
            print(f"{label}: decode speed-up over full-T {tps / full:.2f}x (goal >= 1.5x)")


if __name__ == "__main__":
    main()
