"""Score a looped model at several inference depths: per-step loss, exit distribution, early-exit
rules and the recurrence's geometry, as a table, a JSON file and plots.

    python tools/evaluate.py --load demo/checkpoint --num-loops 1,2,4,8 --output-dir demo/eval
    python tools/evaluate.py --load CKPT --input-file heldout.jsonl --seq-length 256 --output-dir D
    torchrun --nproc_per_node 2 tools/evaluate.py --load CKPT ...        # tensor parallel

Data: the checkpoint's validation split (its --data-path and --split, in the trainer's sample
order: the samples the trainer's evaluation of these weights scored, so at a finished run's last
checkpoint the loss at the trained depth is the run's final validation loss; ``--valid-window K``
picks the K-th evaluation's; the report names the samples), or ``--data-path``/``--split``,
``--mock-data``, or ``--input-file`` (JSONL or text, tokenized on the fly). ``--task-file`` adds
the accuracy on held-out problems (``tools/make_demo_corpus.py --tasks-output``) by family and k.
``--seq-length``, ``--micro-batch-size``, ``--global-batch-size``, ``--eval-iters`` and the
tokenizer flags default to the checkpoint's. ``--ckpt-step N`` loads iteration N instead of the
latest. ``--bf16`` / ``--fp16`` / ``--fp32``: the precision the model is held in, as
tools/generate.py's (default: on a GPU the checkpoint's; on CPU fp32).
Writes ``depth_sweep.md``, ``depth_sweep.json``, ``loss_vs_depth.png`` and
``exit_distribution.png`` (gated models) into ``--output-dir``, and the validation split's index
cache into its ``cache`` folder (``--data-cache-path`` to put it elsewhere). A progress bar over
the sweep's batch passes goes to stderr on rank 0 (``--no-progress``: none, as
tools/preprocess_data.py's flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time


from megaloop import runtime
from megaloop.arguments import ArgumentParser, FlagCheck, add_dataclass_args, dataclass_from_args
from megaloop.eval.config import EvalConfig, parse_rules
from megaloop.inference.flags import (add_ckpt_step_flag, add_tokenizer_flags,
                                      tokenizer_from_flags)
from megaloop.inference.precision import PrecisionConfig


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                allow_abbrev=False)
    add_dataclass_args(p, EvalConfig)
    add_ckpt_step_flag(p)
    add_tokenizer_flags(p)
    add_dataclass_args(p, PrecisionConfig)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (default: one on rank 0, over every depth's "
                        "batches and exit rules)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = dataclass_from_args(EvalConfig, args)
    cfg.ckpt_step = args.ckpt_step
    precision = dataclass_from_args(PrecisionConfig, args)
    # Every independent refusal at once (megaloop.arguments.FlagCheck)
    flags = FlagCheck()
    tokenizer_cfg = None
    with flags.check():
        precision.validate()
    with flags.check():
        cfg.validate()
    with flags.check():
        tokenizer_cfg = tokenizer_from_flags(args)
    with flags.check():
        if cfg.plots:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError("the plots need matplotlib: pip install -e '.[eval]', or pass "
                                 "--plots false") from None
    if flags.refused():
        return 2

    runtime.quiet_megatron()
    from megaloop.data.tokenizers import build_tokenizer
    from megaloop.eval import report
    from megaloop.eval.data import held_out_batches
    from megaloop.eval.sweep import default_rules, sweep, work_count
    from megaloop.inference.loading import is_hf_folder, load_for_generation, setup_processes
    from megaloop.training.checkpointing import read_tracker
    from megaloop.parallel import initialize

    tp = setup_processes(cfg.seed)
    try:
        start = time.time()
        try:
            model, tokenizer, run = load_for_generation(cfg.load, tp, tokenizer=tokenizer_cfg,
                                                        ckpt_step=cfg.ckpt_step,
                                                        precision=precision)
            if tokenizer_cfg is not None:
                tokenizer = build_tokenizer(tokenizer_cfg)
                run = {**run, "tokenizer": dataclasses.asdict(tokenizer_cfg)}
            trained = model.loop.num_loops
            depths = cfg.depths or list(range(1, 2 * trained + 1))
            rules = parse_rules(cfg.exit_rules)
            rules = default_rules(model) if rules is None else rules
            iteration = None
            if not is_hf_folder(cfg.load):
                iteration = cfg.ckpt_step if cfg.ckpt_step is not None else \
                    read_tracker(cfg.load)
            batches, shape, data = held_out_batches(cfg, run, tokenizer, iteration)
            tasks = None
            if cfg.task_file:
                from megaloop.eval.tasks import encode, read_tasks

                items = read_tasks(cfg.task_file, cfg.max_tasks)
                tasks = (items, encode(items, tokenizer, shape.seq_length),
                         tokenizer.vocab_size)
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        runtime.print_rank_0(
            f"> evaluating {cfg.load} (trained T = {trained}, TP {tp}) at depths "
            f"{','.join(map(str, depths))}; exit rules {','.join(rules) or 'none'}\n"
            f"> data: {data}")
        from tqdm import tqdm

        bar = tqdm(total=work_count(batches, depths, rules), desc="depth sweep", unit="batch",
                   disable=args.no_progress or not runtime.is_rank_zero(), dynamic_ncols=True)

        def depth_done(line: str) -> None:
            if runtime.is_rank_zero():  # tqdm.write: the line (stdout) does not cut the bar
                tqdm.write(line, file=sys.stdout)
                sys.stdout.flush()

        try:
            results = sweep(model, batches, depths, rules, tasks=tasks, bar=bar,
                            progress=depth_done)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            bar.close()
        meta = {"load": cfg.load, "data": data, "trained_loops": trained,
                "seq_length": shape.seq_length, "exit_rules": rules}
        if runtime.is_rank_zero():
            paths = report.write(results, meta, cfg.output_dir, cfg.plots)
            print(report.markdown(results, meta), flush=True)
            print(f"> wrote {', '.join(paths)} in {time.time() - start:.1f} s", flush=True)
    finally:
        initialize.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
