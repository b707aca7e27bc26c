"""Attention probes of a saved looped model ("SpiralFormer" (arXiv 2602.11698) section 4), per loop
step and core head.

Loads the latest checkpoint of --load at TP = 1 (whatever TP/PP saved it; dist_checkpointing
reshards) through megaloop/training/checkpointing.py, runs validation sequences through it and
writes key-marginal entropy and local attention mass (LAM) per (loop step, layer, head) as a
Markdown table (<output>.md, per-step means first) and a plot (<output>.png). Definitions in
megaloop/eval/probes.py.

Sequences: --num-batches x --batch-size windows of --seq-length tokens (default: the trained
length) cut from the *last* documents of --data-path, i.e. the validation part of a split such
as 98,2,0 that trains on the first documents.

    python tools/attention_probes.py --load ckpt --data-path demo/corpus_text_document \\
        --output demo/spiral_probes
"""

from __future__ import annotations

import os


from megaloop.arguments import ArgumentParser
from megaloop.inference.flags import add_ckpt_step_flag


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True,
                   help="checkpoint folder (its latest iteration, or --ckpt-step's)")
    add_ckpt_step_flag(p)
    p.add_argument("--data-path", required=True, help="indexed dataset prefix (.bin/.idx)")
    p.add_argument("--output-prefix", "--output", dest="output", required=True,
                   help="writes <prefix>.md and <prefix>.png")
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=None, help="default: the trained length")
    p.add_argument("--gamma", type=float, default=32.0, help="LAM window M_t = ceil(gamma r_t)")
    args = p.parse_args(argv)

    from megaloop import runtime

    runtime.quiet_megatron()  # before the first megatron-core import
    import torch

    from megaloop import cpu_shim

    cpu_shim.enable()
    from megaloop.checkpoint.load import load_model
    from megaloop.data.heldout import validation_windows
    from megaloop.eval.probes import AttentionProbe, write_plot, write_table
    from megaloop.parallel.initialize import initialize_single_process

    initialize_single_process()
    model, _, _, run = load_model(args.load, iteration=args.ckpt_step)
    model.eval()
    seq = args.seq_length or run["training"]["seq_length"]
    windows = torch.from_numpy(validation_windows(args.data_path,
                                                  args.num_batches * args.batch_size, seq))
    probe = AttentionProbe(model, gamma=args.gamma)
    with torch.no_grad():
        for ids in windows.split(args.batch_size):
            model(ids, torch.arange(seq).expand_as(ids), None)
    probe.close()
    rows = probe.results()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_table(rows, args.output + ".md")
    write_plot(rows, args.output + ".png")
    print(open(args.output + ".md").read().split("\n\n")[0])
    print(f"wrote {args.output}.md and {args.output}.png")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
