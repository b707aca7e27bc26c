"""Convert between Hugging Face folders and megaloop checkpoints.

Dense-to-loop ("Closing the Loop" (arXiv 2610.00673) section 4): a local Llama (2, 3.x with
"llama3" RoPE scaling, SmolLM), Mistral (no sliding window), Qwen2 / Qwen2.5 or Qwen3 folder
(config.json + *.safetensors) becomes a looped megaloop checkpoint whose core is the whole decoder,
with scalar-mix input injection (w = 0.99), a fresh exit gate, T loops and optional stepwise LoRA.
Every --loop flag of pretrain_looplm.py is accepted; the defaults below follow Closing the Loop's
conversion recipe:

    python tools/convert_checkpoint.py import-hf --hf-dir Qwen3-1.7B-Base --save ckpt/looped \\
        --num-loops 3 [--lora-rank 32] [--tensor-model-parallel-size 2]

A looped folder (Ouro's ``OuroForCausalLM``, e.g. Ouro-1.4B, or one export-hf wrote) imports
as it is: the loop, the norms and the exit gate come from its config.json (every key honoured or
refused by name: megaloop/convert/hf_looped.py), its tokenizer is copied next to the checkpoint and
its early_exit_threshold becomes the default exit rule of generate, serve and lm-eval:

    python tools/convert_checkpoint.py import-hf --hf-dir Ouro-1.4B --save ckpt/ouro \
        [--tensor-model-parallel-size 2]

Either way it prints the pretrain_looplm.py flags that continue training the converted model.
The checkpoint is written by one process at TP = 1 and loads at any TP size (dist_checkpointing
reshards). Every config.json field of a dense family is honoured or refused by name
(megaloop/convert/hf_families.py).

Export (a megaloop checkpoint saved at any TP size -> a Hugging Face folder, loaded with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``):

    python tools/convert_checkpoint.py export-hf --load ckpt/looped --out hf/looped

The folder also holds the run's tokenizer (``AutoTokenizer.from_pretrained(folder)``) and its EOD
as ``eos_token_id`` in config.json and generation_config.json, so ``generate()`` stops at the end
of a document.
"""

from __future__ import annotations

import argparse
import os
import sys


from megaloop import runtime
from megaloop.arguments import ArgumentParser, add_dataclass_args, dataclass_from_args
from megaloop.inference.flags import add_ckpt_step_flag
from megaloop.model.config import LoopConfig


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("import-hf", allow_abbrev=False,
                         help="Hugging Face Llama/Mistral/Qwen2/Qwen3 folder -> looped checkpoint; "
                              "a looped (Ouro, export-hf) folder -> the same model")
    imp.add_argument("--hf-dir", required=True, help="folder with config.json and *.safetensors")
    imp.add_argument("--save", required=True,
                     help="checkpoint directory to write (iteration 0); not one that holds a "
                          "run's checkpoints, and not while a run holds its lock")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="TP size of the training run (checks vocabulary padding; the "
                          "checkpoint itself loads at any TP size)")
    imp.add_argument("--seed", type=int, default=1234,
                     help="seed of the fresh exit gate and LoRA A matrices")
    imp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dataclass_args(imp, LoopConfig)
    # Closing the Loop's dense-to-loop recipe: one mixing scalar (w = 0.99) and the smoothed exit
    # loss.
    recipe = dict(num_loops=3, input_injection="scalar-mix", exit_loss="smoothed")
    imp.set_defaults(**recipe)
    for action in imp._actions:  # keep the "(default: ...)" of the help text truthful
        if action.dest in recipe:
            text = action.help.rsplit("(default:", 1)[0]
            action.help = text + f"(default: {recipe[action.dest]})"

    p.import_hf = imp  # _looped_folder reads which of its flags were given
    exp = sub.add_parser("export-hf", help="megaloop checkpoint -> Hugging Face folder",
                         allow_abbrev=False)
    exp.add_argument("--load", required=True,
                     help="checkpoint directory (its latest iteration, or --ckpt-step's)")
    add_ckpt_step_flag(exp)
    exp.add_argument("--output-dir", "--out", dest="out", required=True,
                     help="folder to write (new or empty); --out is accepted too")
    exp.add_argument("--vocab-size", type=int, default=None,
                     help="trim the padded embedding table to the tokenizer's real vocabulary")
    exp.add_argument("--names",
                     choices=["auto", "ouro", "nanbeige", "huginn", "parcae", "megaloop"],
                     default="auto",
                     help="auto: Ouro's model type and names for Ouro-style models, Huginn's for "
                          "Huginn-style ones, Parcae's for Parcae-style ones, Nanbeige's for a "
                          "checkpoint imported from a Nanbeige folder; nanbeige / huginn: that "
                          "family's config.json and names (its code from the Hub); parcae: "
                          "Parcae's config.json and model.pt (parcae_lm.from_pretrained)")
    exp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="dtype of the written weights")
    exp.add_argument("--tokenizer-model", default=None,
                     help="where the run's tokenizer file (sentencepiece .model or tokenizer.json) "
                          "is on this machine, when not at the path the run read it from; the "
                          "folder gets its files and its EOD as eos_token_id")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runtime.quiet_megatron()  # before the first megatron-core import (both commands)
    try:
        if args.command == "import-hf":
            from megaloop.convert.hf_import import check_source
            from megaloop.inference.flags import PROCESS_SEED_RANGE, check_seed

            # It seeds the process's generators, numpy's among them (0 .. 2**32 - 1).
            check_seed(args.seed, valid=PROCESS_SEED_RANGE,
                       why="numpy's seed range: it seeds the fresh weights' generators")

            if _looped_folder(args.hf_dir, sys.argv[1:] if argv is None else argv,
                             parser.import_hf):
                check_source(args.hf_dir)  # before the process group and the --save lock
                return _import(args, None)
            loop = dataclass_from_args(LoopConfig, args)
            # Range checks of the loop flags before the slow imports (the layer count is checked
            # against config.json later).
            loop.validate(num_layers=loop.num_prelude_layers + loop.num_coda_layers + 1)
            check_source(args.hf_dir)
            return _import(args, loop)
        return _export(args)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _looped_folder(hf_dir: str, argv: list, imp: argparse.ArgumentParser) -> bool:
    """Whether --hf-dir holds a looped model (Ouro's, Nanbeige's, Huginn's, or an export): its loop comes from config.json and nothing is fresh, so a loop flag or --seed given
    here would be ignored; ValueError naming them instead."""
    from megaloop.convert.hf_import import read_hf_config
    from megaloop.convert.hf_looped import is_looped_config

    if not is_looped_config(read_hf_config(hf_dir)):
        return False
    takes = {"--hf-dir", "--save", "--tensor-model-parallel-size", "--no-progress"}
    known = {o for a in imp._actions for o in a.option_strings}
    given = sorted({t.split("=", 1)[0] for t in argv if t.startswith("--")} & known - takes)
    if given:
        raise ValueError(f"{hf_dir} holds a looped model: its loop (steps, norms, exit gate) "
                         f"comes from config.json and none of its weights are fresh, so import-hf "
                         f"takes no {', '.join(given)}; leave them out (pass loop and objective "
                         f"flags to pretrain_looplm.py, which the printed command lists)")
    return True


def _world(seed: int):
    from megaloop import cpu_shim
    from megaloop.parallel.initialize import initialize_single_process

    cpu_shim.enable()
    initialize_single_process(seed=seed)


def _import(args, loop) -> int:
    """import-hf; ``loop``: the dense-to-loop recipe's LoopConfig, None for a looped folder."""
    from megaloop.checkpoint.tracker import check_new_save
    from megaloop.convert.hf_import import import_hf
    from megaloop.parallel.initialize import destroy
    from megaloop.training.config import CheckpointConfig
    from megaloop.training.save_lock import SaveDirInUse, SaveLock

    _world(args.seed)
    created = []  # the folders the lock creates (--save and missing parents), deepest first
    folder = os.path.abspath(args.save)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    lock, flags = None, None
    try:
        # One writer per folder, as for a training run's --save (the trainer's lock and its
        # default staleness), and never over a run's checkpoints: iteration 0 would become
        # `latest` and the run's next resume would load it.
        try:
            lock = SaveLock.acquire(args.save, CheckpointConfig.save_lock_timeout)
        except SaveDirInUse as exc:  # a live run holds it (the message names it)
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        check_new_save(args.save, "import-hf")
        flags = import_hf(args.hf_dir, args.save, loop or LoopConfig(),
                          tp_size=args.tensor_model_parallel_size, seed=args.seed,
                          progress=not args.no_progress)
    finally:
        if lock is not None:
            lock.release()
        if flags is None:  # refused or failed: no empty --save folder left behind
            for path in created:
                if os.path.isdir(path) and not os.listdir(path):
                    os.rmdir(path)
        destroy()
    print(f"> wrote {os.path.join(args.save, 'iter_0000000')} (loads at any TP size)")
    print("> train it with (add your data, batch and optimizer flags):")
    lines = []
    for token in flags:  # one flag and its value per line
        if token.startswith("--") or not lines:
            lines.append(token)
        else:
            lines[-1] += " " + token
    print("torchrun --nproc_per_node N pretrain_looplm.py \\\n  " + " \\\n  ".join(lines))
    return 0


def _export(args) -> int:
    import torch

    from megaloop.convert.hf_export import check_out_dir, export_hf
    from megaloop.parallel.initialize import destroy

    check_out_dir(args.out)  # before the slow load
    _world(0)
    try:
        cfg = export_hf(args.load, args.out, vocab_size=args.vocab_size, names=args.names,
                        dtype=getattr(torch, args.dtype), iteration=args.ckpt_step,
                        tokenizer_model=args.tokenizer_model)
    finally:
        destroy()
    # (Nanbeige's key, Huginn's)
    loops = cfg.get("total_ut_steps", cfg.get("num_loops", cfg.get("mean_recurrence")))
    if "architectures" not in cfg:  # Parcae's (its own loader, not transformers')
        print(f"> wrote {args.out} ({cfg['_class_name']}, {loops} loops, vocab "
              f"{cfg['vocab_size']}); load with parcae_lm.from_pretrained")
        return 0
    print(f"> wrote {args.out} ({cfg['architectures'][0]}, {loops} loops, vocab "
          f"{cfg['vocab_size']}); load with AutoModelForCausalLM.from_pretrained(..., "
          f"trust_remote_code=True)")
    return 0


if __name__ == "__main__":  # the checkpoint writer re-imports __main__ in its workers
    sys.exit(main())
