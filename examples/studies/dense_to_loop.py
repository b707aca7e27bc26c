"""Study 4, dense-to-loop conversion: a trained dense model turned into a T=3 loop through the
import path, continued for the same tokens as the dense model itself.

After "Closing the Loop" (arXiv 2610.00673) section 4: the dense model's whole decoder becomes
the looped core. Three conversions: looped as it is (no input mixing, plain expected exit loss),
with the input-mixing scalar and the smoothed exit loss, and with stepwise LoRA on top. Each is
scored per loop step before and after continued training, against the dense model continued for
the same steps; every seed of the size trains its own dense model, conversions and continuations,
and the final losses are compared with the dense model's continued (mean difference, verdict).

The dense model is trained Llama-shaped (pre-norm, RMSNorm, SwiGLU, RoPE, no biases), so its
export-hf tensors carry Llama's names; a Llama config.json written with ``transformers`` makes
the folder a Llama checkpoint, which ``import-hf`` reads like any downloaded one.

    python examples/studies/dense_to_loop.py --size cpu --output-dir studies_out
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study import (PLATEAU_MARGIN, Study, figure, in_child, machine, md_table,  # noqa: E402
                   spread, unigram_entropy, verdict_cell)

SHAPE = {"tiny": 2, "cpu": 3, "gpu": 8}  # dense layers
T = 3
CONVERSIONS = {
    "looped as it is": ["--input-injection", "none", "--exit-loss", "expected"],
    "input mixing + smoothed exit loss": ["--input-injection", "scalar-mix",
                                          "--exit-loss", "smoothed"],
    "input mixing + smoothed + stepwise LoRA": ["--input-injection", "scalar-mix",
                                                "--exit-loss", "smoothed", "--lora-rank", "8"],
}


def export_as_llama(ckpt: str, folder: str) -> str:
    """The dense checkpoint as a Llama folder (config.json from transformers' LlamaConfig)."""
    import glob

    from transformers import LlamaConfig

    from megaloop import cpu_shim
    from megaloop.convert.hf_export import export_hf
    from megaloop.parallel.initialize import destroy, initialize_single_process

    cpu_shim.enable()
    initialize_single_process()
    try:
        cfg = export_hf(ckpt, folder, names="megaloop")
    finally:
        destroy()
    for name in glob.glob(os.path.join(folder, "*.py")):  # megaloop's modeling code: not Llama's
        os.remove(name)
    heads = cfg["num_attention_heads"]
    LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def convert(folder: str, save: str, flags: list) -> list:
    """import-hf into ``save``; the training flags it prints."""
    from megaloop import cpu_shim
    from megaloop.arguments import dataclass_from_args
    from megaloop.convert.hf_import import import_hf
    from megaloop.model.config import LoopConfig
    from megaloop.parallel.initialize import destroy, initialize_single_process

    from megaloop.cli import convert_checkpoint as tool  # tools/convert_checkpoint.py's

    args = tool.build_parser().parse_args(["import-hf", "--hf-dir", folder, "--save", save,
                                           "--num-loops", str(T), "--no-progress", *flags])
    loop = dataclass_from_args(LoopConfig, args)
    cpu_shim.enable()
    initialize_single_process()
    try:
        return import_hf(folder, save, loop, progress=False)
    finally:
        destroy()


def without_tokenizer(flags: list) -> list:
    """import-hf's flags name the table's ids (NullTokenizer); the study's tokenizer is kept."""
    out, skip = [], 0
    for i, token in enumerate(flags):
        if skip:
            skip -= 1
            continue
        if token in ("--tokenizer-type", "--vocab-size", "--tokenizer-model"):
            skip = 1
            continue
        out.append(token)
    return out


def main(argv=None) -> int:
    load_at_start = os.getloadavg()
    study = Study("dense_to_loop", __doc__, argv)
    layers = SHAPE[study.size["name"]]
    iters = study.size["iters"]
    data = ["--data-path", study.data_prefix, "--split", "98,2,0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", study.tokenizer,
            "--seq-length", str(study.size["seq"]),
            "--micro-batch-size", str(study.size["mbs"]),
            "--global-batch-size", str(study.size["gbs"]),
            "--eval-iters", str(study.size["eval_iters"])]
    dense_flags = ["--num-layers", str(layers), "--num-loops", "1", "--norm-scheme", "pre"]
    at_t = lambda ev: ev["depths"][-1]  # noqa: E731
    # model -> per seed: (per-step loss after conversion, after continued training, final loss)
    results = {name: [] for name in [*CONVERSIONS, "dense, continued"]}
    curves = {name: [] for name in results}
    dense_loss = []  # per seed: the dense model's final validation loss before conversion
    for seed in study.seeds:  # each seed: its own dense model, conversions and continuations
        dense = study.train("dense", dense_flags, seed=seed)
        dense_loss.append([r for r in dense["records"] if r["split"] == "valid"][-1]["loss"])
        folder = in_child(export_as_llama, dense["ckpt"],
                          os.path.join(study.run_dir, f"dense_llama_{seed}"))
        for name, flags in CONVERSIONS.items():
            save = os.path.join(study.run_dir, "converted", f"seed_{seed}",
                                name.replace(" ", "_").replace("+", ""))
            train_flags = without_tokenizer(in_child(convert, folder, save, flags))
            before = study.evaluate(name, save, list(range(1, T + 1)), extra=data,
                                    tag="before", seed=seed)
            after_run = study.train(name, train_flags, iters=iters, seed=seed)
            after = study.evaluate(name, after_run["ckpt"], list(range(1, T + 1)), extra=data,
                                   tag="after", seed=seed)
            results[name].append((at_t(before)["step_losses"], at_t(after)["step_losses"],
                                  at_t(after)["loss"]))
            curves[name].append(after_run["records"])
        continued = study.train("dense continued", dense_flags + ["--load", dense["ckpt"],
                                                                  "--finetune"],
                                iters=iters, seed=seed)
        dense_before = study.evaluate("dense", dense["ckpt"], [1], extra=data, tag="before",
                                      seed=seed)
        dense_after = study.evaluate("dense continued", continued["ckpt"], [1], extra=data,
                                     tag="after", seed=seed)
        results["dense, continued"].append((dense_before["depths"][0]["step_losses"],
                                            dense_after["depths"][0]["step_losses"],
                                            dense_after["depths"][0]["loss"]))
        curves["dense, continued"].append(continued["records"])

    def per_step(values):  # [seed][step] -> "m ± sd / m ± sd / ..."
        return " / ".join(spread([v[t] for v in values]) for t in range(len(values[0])))

    dense_final = [r[2] for r in results["dense, continued"]]
    plateau = unigram_entropy(study.data_prefix)
    left = sum(v < plateau - PLATEAU_MARGIN for v in dense_loss)
    rows = [[name, per_step([r[0] for r in rs]), per_step([r[1] for r in rs]),
             spread([r[2] for r in rs]),
             f"{sum(r[2] < plateau - PLATEAU_MARGIN for r in rs)} of {len(rs)}",
             "-" if name == "dense, continued" else verdict_cell([r[2] for r in rs],
                                                                 dense_final)]
            for name, rs in results.items()]

    fig, axes = figure(1)
    for i, (name, per_seed) in enumerate(curves.items()):
        for j, records in enumerate(per_seed):
            valid = [r for r in records if r["split"] == "valid"]
            train = [r for r in records if r["split"] == "train"]
            axes[0].plot([r["iteration"] for r in train], [r["step_losses"][-1] for r in train],
                         color=f"C{i}", lw=1,
                         label=f"{name} (train, last step)" if j == 0 else None)
            axes[0].plot([r["iteration"] for r in valid], [r["step_losses"][-1] for r in valid],
                         "o", color=f"C{i}")
    axes[0].set_xlabel("iteration of continued training")
    axes[0].set_ylabel("LM loss at the last loop step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    study.write(
        "Dense-to-loop conversion",
        f"python examples/studies/dense_to_loop.py --size {study.size['name']}",
        [machine(load_at_start),
         f"A {layers}-layer dense model (pre-norm, LR {study.size['lr']} with warmup and cosine "
         f"decay) trained for {iters} iterations: final validation loss {spread(dense_loss)}; "
         f"it left the initial plateau (the corpus's unigram entropy, {plateau:.3f} nats; final "
         f"loss more than {PLATEAU_MARGIN} below) in {left} of {len(dense_loss)} seeds. It is "
         f"converted to "
         f"T = {T} (the whole decoder is the core) and continued for {iters} more; the dense "
         f"model continued for the same {iters}. Held-out loss per loop step:",
         md_table(["model", "per-step loss after conversion", "per-step loss after continued "
                   "training", "final loss", "left the plateau",
                   "final loss vs dense, continued"], rows)],
        figure=fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
