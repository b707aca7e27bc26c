"""The GPU check's command lines and verdicts.

Every row is a list of ``pretrain_looplm.py`` flags. On a GPU they run as written; without one
``cpu_flags`` swaps the GPU-only flags (Transformer Engine spec -> local, bf16 -> fp32, FP8
dropped, gloo) and shrinks the shapes, and nothing else: the schedule, checkpoint and loop
flags a CPU rehearsal runs are the GPU run's, so a mistake in them fails on CPU first.
The verdict functions read only what the run itself reported (losses, applied steps, times).
"""

from __future__ import annotations

import math

# --- the models -------------------------------------------------------------------------------
# Small model of the gradient and smoke rows: T = 3, mock data.
TINY = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--lr-decay-style", "cosine", "--num-workers", "0",
        "--num-layers", "2", "--num-loops", "3", "--hidden-size", "128",
        "--num-attention-heads", "4", "--ffn-hidden-size", "352", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "1234"]
TE = ["--transformer-impl", "transformer_engine"]
LOCAL = ["--transformer-impl", "local"]
BF16 = ["--bf16"]
# Inference in fp32 whatever the checkpoint trained in (the TE generate row's comparison: its
# tolerance, TE_LOGITS_TOL, is derived for fp32; on a GPU a --bf16 checkpoint loads in bf16)
FP32 = ["--fp32"]
VARIANTS = {
    "ouro": ["--norm-scheme", "ouro"],
    "ouro+lora": ["--norm-scheme", "ouro", "--lora-rank", "4"],
    "ouro+adaln": ["--norm-scheme", "ouro", "--timestep-conditioning", "adaln"],
    "post": ["--norm-scheme", "post"],
}
# The ~1B shape of the FP8 and throughput rows: 6 layers x T = 4 against its dense twin of
# equal effective depth, 24 layers.
BIG = ["--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "5632",
       "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear",
       "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "32000", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
       "--lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
       "--num-workers", "0", "--eval-iters", "0", "--seed", "1234", *BF16, *TE]
LOOPED = {"expected": ["--num-layers", "6", "--num-loops", "4", "--exit-loss", "expected"],
          "last": ["--num-layers", "6", "--num-loops", "4", "--exit-loss", "last"]}
DENSE = ["--num-layers", "24", "--num-loops", "1"]
FP8 = {"delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],  # Megatron-LM's default
       "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]}


# --- the command lines of the rows (as on a GPU) -------------------------------------------------
def grads_runs() -> list:
    """(precision, variant, reference argv with the local spec, argv with TE) per gradient row."""
    return [(precision, variant, [*TINY, *flags, *extra, "--train-iters", "2", *LOCAL],
             [*TINY, *flags, *extra, "--train-iters", "2", *TE])
            for precision, extra in (("bf16", BF16), ("fp32", []))
            for variant, flags in VARIANTS.items()]


def smoke_runs(d: str) -> dict:
    """The smoke row's three launches, logging to ``d``. One schedule for all three:
    --train-iters 7 (the LR decay and the weight-decay steps follow it) and --lr-decay-iters 7;
    the first launch stops after saving at 5 (--exit-interval), so the resume continues the very
    schedule it was saved with (a changed one is refused at load)."""
    ckpt = f"{d}/ckpt"
    base = [*TINY, *TE, *BF16, "--train-iters", "7", "--lr-warmup-iters", "1",
            "--lr-decay-iters", "7", "--eval-interval", "5", "--eval-iters", "2"]
    return {"ckpt": ckpt,
            "first": [*base, "--save", ckpt, "--save-interval", "5", "--exit-interval", "5",
                      "--log-jsonl", f"{d}/first.jsonl"],
            "resume": [*base, "--load", ckpt, "--log-jsonl", f"{d}/resume.jsonl"],
            "straight": [*base, "--log-jsonl", f"{d}/straight.jsonl"]}


# (FP8 comparison steps, warm-up steps, timed steps) on a GPU; a CPU rehearsal takes fewer (the
# flags, --train-iters included, are the same).
STEPS = {True: (10, 10, 20), False: (2, 1, 2)}


def timed_runs(gpu: bool) -> dict:
    """name -> (argv, steps, warm-up steps before the timed ones) of the FP8 and throughput
    runs, in the order they run: the bf16 reference and the FP8 recipes on the looped model
    first (their first steps are the FP8 rows), then the throughput-only runs."""
    compare, warmup, timed = STEPS[gpu]
    long_warmup = max(compare, warmup)
    looped = [*BIG, *LOOPED["expected"]]
    runs = {"looped-expected-bf16": (looped, long_warmup + timed, long_warmup)}
    for recipe, flags in FP8.items():
        runs[f"looped-expected-fp8-{recipe}"] = ([*looped, *flags], long_warmup + timed,
                                                 long_warmup)
    runs["looped-last-bf16"] = ([*BIG, *LOOPED["last"]], warmup + timed, warmup)
    runs["dense-bf16"] = ([*BIG, *DENSE], warmup + timed, warmup)
    runs["dense-fp8-tensorwise"] = ([*BIG, *DENSE, *FP8["tensorwise"]], warmup + timed, warmup)
    return {k: ([*argv, "--train-iters", str(steps)], steps, skip)
            for k, (argv, steps, skip) in runs.items()}


# --- tolerances ---------------------------------------------------------------------------------
# fp32 TE vs local: TE runs fp32 GEMMs in TF32, the local spec in fp32. max |g_te - g_local| over
# max |g_local| per tensor, and the loss relative. The hazard these rows guard (TE linears
# overwriting instead of accumulating weight gradients across the T calls, Megatron-LM PR #6965)
# leaves the core's weight gradients at one step's share: relative errors ~0.5, cosines ~0.6.
GRAD_RTOL_FP32, LOSS_RTOL_FP32 = 3e-2, 5e-3
# bf16 TE (flash/cuDNN attention, bf16 GEMMs) vs local bf16: the global gradient cosine (all
# parameters as one vector) and the cosine of each parameter's gradient.
GRAD_COS_BF16 = 0.999
# A parameter whose gradient norm, in both runs, is below this fraction of the reference's global
# gradient norm is exempt from the per-parameter checks (still counted in the global cosine). At
# initialisation some gradients are sums that nearly cancel (the exit gate's bias, norm scales):
# what is left is of the order of the rounding of the terms, so its direction is noise in any
# precision. Such a parameter carries under 1e-6 of the squared gradient norm; the weights the
# hazard of these rows hits (the core's linears) carry most of it and are never exempt.
GRAD_TINY_FRAC = 1e-3
# FP8 against bf16 from the same weights and batches: every one of the first steps' losses
# within this relative distance. E4M3 keeps 3 mantissa bits, but the GEMMs accumulate in fp32
# and the scales are per tensor, so FP8 training tracks bf16 to well under 1% of the loss early
# in training; 3% catches a broken recipe (NaN-free but wrong scales give tens of percent).
FP8_LOSS_RTOL = 3e-2
# Proof that FP8 ran (a run whose FP8 silently never engaged is bf16 and passes the 3% above):
# its step-1 loss differs from bf16's (bitwise equal means the same arithmetic) but by at most
# 1% (same weights and batch; one forward in E4M3 moves the loss by a fraction of a percent);
# Transformer Engine's modules report FP8 in their state; and the first step's gradient of one
# core weight (megaloop.gpu_check.probes.GRAD_PROBE_PARAM) is not bitwise bf16's and has a
# cosine with it of at least FP8_GRAD_COS. E4M3 forward / E5M2 backward rounding is ~2-6% per
# element but averages out over the thousands of tokens a weight gradient sums, leaving cosines
# well above 0.95; a wrong scale (saturated or flushed values) or a lost contribution gives far
# less. 0.9 leaves room for the noise of 24 effective FP8 layers between the loss and that layer.
# Judged for the current-scaling recipe only: delayed scaling casts step 1 with its initial scale
# of 1 (no amax history yet), so its first backward may flush small gradients to zero in E5M2, a
# property of the recipe rather than a broken path; its cosine is reported, not judged.
FP8_STEP1_RTOL = 1e-2
FP8_GRAD_COS = 0.9
FP8_GRAD_COS_JUDGED = ("tensorwise",)
# The TE recipe class megatron-core builds for each --fp8-recipe.
FP8_RECIPE_CLASS = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling"}
# TE against local generation from the smoke checkpoint: the teacher-forced logits of the prompt and
# the local build's continuation, one checkpoint built twice, in fp32 both times
# (megaloop.gpu_check.probes.generation_logits refuses a model held in any other precision). The two
# differ by arithmetic alone: TE runs its fp32 GEMMs with TF32 inputs (cuBLASLt's
# CUBLAS_COMPUTE_32F_FAST_TF32: 10 mantissa bits, unit roundoff u = 2^-11 = 4.9e-4) where the local
# layers' matmuls stay fp32 (torch's default), and its fused norm and RoPE kernels sum in another
# order (fp32 rounding, ~1e-7: negligible). Rounding both factors of a product moves it by up to 2u
# with a random sign, so a dot product of d terms errs by about 2u times its own typical size (value
# and error are both random-sign sums of d terms). The smoke model applies 2 layers x T = 3 = 6
# layer applications of 4 TE GEMMs each (QKV, attention projection, fc1, fc2); counting the
# attention's two batched GEMMs too, in case they also ran in TF32, 36 independent errors of 2u add
# in quadrature through the residual stream: sqrt(36) x 2u = 5.9e-3 of the hidden state's scale,
# carried linearly into the logits by the output layer (not a TE module: fp32 in both builds). A
# logit's error therefore scales with the RMS of all logits, not with its own size (a logit near 0
# errs as much as a large one): atol = tol x RMS(local logits), rtol = 0. The largest of the ~1.2e4
# compared errors (12 positions x 1025 ids) is about 4 standard deviations of a Gaussian: 2.4e-2 x
# RMS; 5e-2 doubles that for what the estimate leaves out (each loop step re-reads the previous
# step's rounded output through the block). What this row exists to catch is structural and moves
# logits by O(1) x RMS: TE's attention without the causal mask, another number of loop steps,
# positions or weights mapped wrong.
TE_LOGITS_TOL = 5e-2
# Greedy ids are compared only where they cannot part by rounding: at a position whose local top-2
# margin exceeds 2 x atol (each of the two logits may move by atol towards the other); after the
# first near-tie the two continuations may legitimately differ, so nothing after it is compared.
MFU_RATIO_GOAL = 0.98  # looped (`last`) / dense MFU: the loop itself should cost nothing
FP8_SPEEDUP_GOAL = 1.3
# Dense (no sparsity) BF16 tensor-core peak per GPU, FLOP/s; matched against the device name in
# order (PCIe/NVL parts before the SXM default). GPU_CHECK_PEAK_TFLOPS overrides.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("GH200", 989e12), ("H100", 989e12),
             ("H200 NVL", 835e12), ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12)]

# --- the CPU rehearsal's swap -------------------------------------------------------------------
GPU_ONLY = {"--bf16": 0, "--fp8-format": 1, "--fp8-recipe": 1}  # flag: values it takes
SHAPES = {"--hidden-size": {"2048": "64", "128": "64"}, "--ffn-hidden-size": {"5632": "176",
                                                                               "352": "176"},
          "--seq-length": {"2048": "64", "128": "64"},
          "--max-position-embeddings": {"2048": "64", "128": "64"},
          "--vocab-size": {"32000": "512", "1024": "512"},
          "--global-batch-size": {"8": "4"},
          "--num-layers": {"6": "2", "24": "8"}}  # 2 x 4 against 8: equal effective depth


def cpu_flags(argv: list) -> list:
    """``argv`` as a CPU machine runs it: GPU-only flags dropped, the local spec, gloo, tiny
    shapes; every other flag (schedule, checkpoints, loop, objective) unchanged."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if flag in GPU_ONLY:
            i += 1 + GPU_ONLY[flag]
            continue
        if flag == "--transformer-impl":
            out += ["--transformer-impl", "local"]
            i += 2
            continue
        if flag in SHAPES and i + 1 < len(argv):
            out += [flag, SHAPES[flag].get(argv[i + 1], argv[i + 1])]
            i += 2
            continue
        out.append(flag)
        i += 1
    return out + ["--distributed-backend", "gloo"]


# --- verdicts -------------------------------------------------------------------------------------
def bf16_resolution(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits): a loss known to this."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 0.0


def finite(values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def global_cosine(params: dict) -> float:
    """The cosine of all gradients as one vector, from each parameter's dot product and norms."""
    dot = sum(v["dot"] for v in params.values())
    na = math.sqrt(sum(v["norm_a"] ** 2 for v in params.values()))
    nb = math.sqrt(sum(v["norm_b"] ** 2 for v in params.values()))
    return 1.0 if na == nb == 0 else dot / max(na * nb, 1e-300)


def grads_verdict(r: dict, precision: str) -> tuple[bool, str, dict]:
    """A TE-vs-local gradient row: both steps applied, losses finite, the global gradient cosine
    >= GRAD_COS_BF16 and, per parameter except those with tiny gradients (GRAD_TINY_FRAC, named
    in the detail), the bf16 cosine or fp32 relative-error tolerance; the loss to bf16
    resolution / fp32 rtol."""
    problems = []
    if not all(r["applied"]):
        problems.append(f"optimizer step skipped (applied {r['applied']})")
    losses = [r["loss_a"], r["loss_b"], *r["step_losses_a"], *r["step_losses_b"]]
    if not finite(losses):
        problems.append(f"non-finite loss {losses}")
        return False, "; ".join(problems), {}
    all_params = r["params"]
    global_norm = math.sqrt(sum(v["norm_a"] ** 2 for v in all_params.values()))
    # Tiny in both runs: a gradient under test that is large where the reference's is tiny
    # stays checked. Exactly zero in both (LoRA's A at init, B being zero) is equality, not
    # noise: checked too (and passes), so the exempt list names only the noisy ones.
    exempt = sorted(k for k, v in all_params.items()
                    if max(v["norm_a"], v["norm_b"]) < GRAD_TINY_FRAC * global_norm
                    and not v["norm_a"] == v["norm_b"] == 0)
    params = {k: v for k, v in all_params.items() if k not in exempt}
    cos_all = global_cosine(all_params)
    worst_cos = min(params.items(), key=lambda kv: kv[1]["cos"])
    worst_rel = max(params.items(), key=lambda kv: kv[1]["rel"])
    dloss = abs(r["loss_a"] - r["loss_b"])
    numbers = {"loss_local": r["loss_a"], "loss_te": r["loss_b"], "loss_diff": dloss,
               "global_cos": cos_all, "min_cos": worst_cos[1]["cos"],
               "min_cos_param": worst_cos[0], "max_rel": worst_rel[1]["rel"],
               "max_rel_param": worst_rel[0], "init_max_diff": r["init_max_diff"],
               "params": len(all_params), "exempt": exempt, "exempt_below": GRAD_TINY_FRAC}
    if cos_all < GRAD_COS_BF16:
        problems.append(f"global gradient cosine {cos_all:.5f} < {GRAD_COS_BF16}")
    exempted = (f"; exempt (gradient norm < {GRAD_TINY_FRAC:g} x global): "
                f"{', '.join(exempt)}" if exempt else "")
    if precision == "bf16":
        tol = bf16_resolution(r["loss_a"])
        steps = max(abs(x - y) for x, y in zip(r["step_losses_a"], r["step_losses_b"]))
        if dloss > tol or steps > 2 * tol:
            problems.append(f"loss {r['loss_a']:.4f} vs {r['loss_b']:.4f}: |diff| {dloss:.2g} "
                            f"(steps {steps:.2g}) > bf16 resolution {tol:.2g}")
        bad = [k for k, v in params.items() if v["cos"] < GRAD_COS_BF16]
        if bad:
            problems.append(f"{len(bad)} gradients with cosine < {GRAD_COS_BF16}, worst "
                            f"{worst_cos[0]} {worst_cos[1]['cos']:.4f}")
        detail = (f"loss {r['loss_a']:.4f} vs {r['loss_b']:.4f} (|diff| {dloss:.1e}, bf16 "
                  f"resolution {tol:.1e}); global gradient cosine {cos_all:.5f}; "
                  f"{len(params)} grads, min cosine {worst_cos[1]['cos']:.5f} ({worst_cos[0]})")
    else:
        rel = dloss / abs(r["loss_a"])
        steps = max(abs(x - y) / abs(x) for x, y in zip(r["step_losses_a"], r["step_losses_b"]))
        if rel > LOSS_RTOL_FP32 or steps > LOSS_RTOL_FP32:
            problems.append(f"loss rel diff {rel:.2g} (steps {steps:.2g}) > {LOSS_RTOL_FP32}")
        if worst_rel[1]["rel"] > GRAD_RTOL_FP32:
            problems.append(f"gradient rel err {worst_rel[1]['rel']:.2g} > {GRAD_RTOL_FP32} "
                            f"({worst_rel[0]})")
        detail = (f"loss {r['loss_a']:.4f} vs {r['loss_b']:.4f} (rel {rel:.1e}); global "
                  f"gradient cosine {cos_all:.5f}; {len(params)} grads, worst rel "
                  f"{worst_rel[1]['rel']:.1e} ({worst_rel[0]}); tol "
                  f"{GRAD_RTOL_FP32:g}/{LOSS_RTOL_FP32:g}")
    return not problems, "; ".join(problems + ([exempted[2:]] if problems and exempt else [])) \
        or detail + exempted, numbers


def train_records(path: str) -> list:
    import json
    import os

    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def smoke_verdict(records: list, iterations: list, rc: int, what: str) -> list:
    """Problems of one smoke launch from its own exit code and JSONL: the expected iterations,
    each applied (no skipped steps) with a finite loss."""
    train = [r for r in records if r["split"] == "train"]
    problems = [] if rc == 0 else [f"{what} exited {rc}"]
    if [r["iteration"] for r in train] != iterations:
        problems.append(f"{what}: train iterations {[r['iteration'] for r in train]}, "
                        f"expected {iterations}")
    if any(r.get("skipped_iters") for r in train):
        problems.append(f"{what}: skipped steps {[r.get('skipped_iters') for r in train]}")
    if not finite(r["loss"] for r in train):
        problems.append(f"{what}: non-finite loss {[r['loss'] for r in train]}")
    return problems


def steps_verdict(r: dict, what: str) -> list:
    """Problems of a timed run: every step applied, every loss finite."""
    problems = []
    if not all(r["applied"]):
        skipped = [i + 1 for i, a in enumerate(r["applied"]) if not a]
        problems.append(f"{what}: steps not applied (skipped) at {skipped}")
    if not finite(r["losses"]):
        problems.append(f"{what}: non-finite losses {r['losses']}")
    return problems


def fp8_ran_problems(fp8: dict, bf16: dict, recipe: str) -> list:
    """Why the FP8 run is not shown to have run in FP8 (empty: shown), from its own report and
    the bf16 reference's: step-1 losses (FP8_STEP1_RTOL), Transformer Engine's FP8 state
    (megaloop.gpu_check.probes.fp8_evidence) and one layer's gradient (FP8_GRAD_COS)."""
    problems = []
    a, b = fp8["losses"][0], bf16["losses"][0]
    if a == b:
        problems.append(f"step-1 loss bitwise equal to bf16's ({a!r}): FP8 did not run")
    elif abs(a - b) / abs(b) > FP8_STEP1_RTOL:
        problems.append(f"step-1 loss {a:.5f} vs bf16 {b:.5f}: relative difference "
                        f"{abs(a - b) / abs(b):.2e} > {FP8_STEP1_RTOL:g}")
    ev = fp8.get("fp8_evidence") or {}
    if not ev.get("te"):
        problems.append(f"no Transformer Engine state to read ({ev.get('why', 'not reported')})")
    else:
        if not ev["modules_fp8"]:
            problems.append(f"none of the {ev['modules']} TE modules ran under FP8")
        if FP8_RECIPE_CLASS[recipe] not in ev["recipes"]:
            problems.append(f"TE modules report recipes {ev['recipes']}, not "
                            f"{FP8_RECIPE_CLASS[recipe]}")
        if recipe == "delayed" and not ev["modules_with_amax_history"]:
            problems.append("no TE module recorded an amax history (delayed scaling keeps one)")
        if not any(ev["extra_state_fp8"]):
            problems.append("no TE module keeps FP8 scaling state in its extra state")
    if (bf16.get("fp8_evidence") or {}).get("modules_fp8"):
        problems.append(f"the bf16 reference ran {bf16['fp8_evidence']['modules_fp8']} TE "
                        f"modules under FP8")
    cos = fp8.get("grad_cosine")
    if cos is None:
        problems.append("no first-step gradient compared with bf16's")
    elif fp8.get("grad_bitwise_equal"):
        problems.append(f"first-step gradient of {fp8.get('grad_param')} bitwise equal to "
                        f"bf16's")
    elif recipe in FP8_GRAD_COS_JUDGED and not cos >= FP8_GRAD_COS:
        problems.append(f"first-step gradient cosine against bf16 {cos:.4f} < {FP8_GRAD_COS} "
                        f"({fp8.get('grad_param')})")
    return problems


def fp8_verdict(fp8: dict, bf16: dict, steps: int, recipe: str,
                gpu: bool = True) -> tuple[bool, str, dict]:
    """An FP8 row: the first ``steps`` steps of both runs applied with finite losses, each FP8
    loss within FP8_LOSS_RTOL of bf16's, and (on a GPU) the proof that FP8 ran
    (``fp8_ran_problems``). Without a GPU the FP8 flags were dropped, so the proof cannot hold:
    what it found is reported, not judged."""
    problems = steps_verdict({"applied": fp8["applied"][:steps], "losses": fp8["losses"][:steps]},
                             f"fp8 {recipe}")
    problems += steps_verdict({"applied": bf16["applied"][:steps],
                               "losses": bf16["losses"][:steps]}, "bf16 reference")
    if problems:
        return False, "; ".join(problems), {}
    rel = [abs(a - b) / abs(b) for a, b in zip(fp8["losses"][:steps], bf16["losses"][:steps])]
    worst = max(range(steps), key=lambda i: rel[i])
    not_proven = fp8_ran_problems(fp8, bf16, recipe)
    numbers = {"losses_fp8": fp8["losses"][:steps], "losses_bf16": bf16["losses"][:steps],
               "max_rel_diff": rel[worst], "at_step": worst + 1, "step1_rel_diff": rel[0],
               "grad_cosine": fp8.get("grad_cosine"), "grad_param": fp8.get("grad_param"),
               "fp8_evidence": fp8.get("fp8_evidence"), "fp8_not_proven": not_proven}
    if rel[worst] > FP8_LOSS_RTOL:
        problems.append(f"max |fp8 - bf16| / bf16 {rel[worst]:.2e} at step {worst + 1} > "
                        f"{FP8_LOSS_RTOL:g}")
    if gpu:
        problems += not_proven
    cos = fp8.get("grad_cosine")
    ev = fp8.get("fp8_evidence") or {}
    detail = (f"{steps} steps all applied, losses finite; max |fp8 - bf16| / bf16 "
              f"{rel[worst]:.2e} at step {worst + 1} (tol {FP8_LOSS_RTOL:g}); step 1 "
              f"{rel[0]:.2e} (FP8 ran: > 0 and <= {FP8_STEP1_RTOL:g}); "
              f"{fp8.get('grad_param')} gradient cosine vs bf16 "
              f"{'n/a' if cos is None else f'{cos:.4f}'} ("
              f"{f'>= {FP8_GRAD_COS}' if recipe in FP8_GRAD_COS_JUDGED else 'reported only'}"
              f"); TE modules in "
              f"FP8 {ev.get('modules_fp8', 'n/a')} of {ev.get('modules', 'n/a')}, recipes "
              f"{ev.get('recipes', 'n/a')}; loss {fp8['losses'][0]:.3f} -> "
              f"{fp8['losses'][steps - 1]:.3f} (bf16 {bf16['losses'][steps - 1]:.3f})")
    if not gpu:
        detail += ("; FP8-ran proof not judged without a GPU, it finds: "
                   + ("; ".join(not_proven) or "nothing missing"))
    return not problems, "; ".join(problems) or detail, numbers


def _top2(row: list) -> tuple[int, float]:
    """(argmax, top-1 minus top-2) of one position's logits; a tie has margin 0."""
    best = max(range(len(row)), key=row.__getitem__)
    return best, row[best] - max(v for i, v in enumerate(row) if i != best)


def te_generation_verdict(local: list, te: list, local_ids: list, te_ids: list,
                          prompt_len: int) -> tuple[bool, str, dict]:
    """The TE generate row: ``local`` and ``te`` are the teacher-forced fp32 logits
    [positions][vocabulary] of the prompt followed by ``local_ids`` (the local build's greedy
    ids from tools/generate.py), from the local and the TE build of one checkpoint; ``te_ids``
    are the ids tools/generate.py printed with --transformer-impl transformer_engine. Every
    logit within TE_LOGITS_TOL x RMS(local) of the local one, and each greedy id equal to the
    local teacher-forced argmax (both tools' ids) up to the first near-tie."""
    shape = (len(local), len(local[0]) if local else 0)
    te_shape = (len(te), len(te[0]) if te else 0)
    if te_shape != shape or shape[0] != prompt_len + len(local_ids):
        return False, (f"logits of shape {te_shape} (TE) and {shape} (local), expected "
                       f"{prompt_len} prompt + {len(local_ids)} generated positions"), {}
    flat_local = [v for row in local for v in row]
    flat_te = [v for row in te for v in row]
    if not finite(flat_local) or not finite(flat_te):
        return False, (f"non-finite logits (local all finite: {finite(flat_local)}, TE: "
                       f"{finite(flat_te)})"), {}
    rms = math.sqrt(sum(v * v for v in flat_local) / len(flat_local))
    atol = TE_LOGITS_TOL * rms
    worst = max(range(len(flat_local)), key=lambda i: abs(flat_te[i] - flat_local[i]))
    diff = abs(flat_te[worst] - flat_local[worst])
    at = divmod(worst, shape[1])  # (position, token id)
    problems = []
    if diff > atol:
        problems.append(f"max |TE - local| logit {diff:.3g} at position {at[0]}, id {at[1]} > "
                        f"tolerance {atol:.3g} ({TE_LOGITS_TOL:g} x RMS {rms:.3g})")
    compared, near_tie, margins = 0, None, []
    for j, token in enumerate(local_ids):
        p = prompt_len - 1 + j  # the position whose logits chose generated token j
        ref, margin = _top2(local[p])
        margins.append(margin)
        if margin <= 2 * atol:
            near_tie = j + 1
            break
        if token != ref:
            problems.append(f"the local tools/generate.py id {j + 1} is {token}, its "
                            f"teacher-forced argmax {ref} (top-2 margin {margin:.3g})")
            break
        if j >= len(te_ids) or te_ids[j] != ref:
            got = te_ids[j] if j < len(te_ids) else "none (it stopped)"
            problems.append(f"TE's id {j + 1} is {got}, the local build's {ref}, whose top-2 "
                            f"margin {margin:.3g} > 2 x tolerance {2 * atol:.3g} (not a near-tie)")
            break
        compared += 1
    else:
        if len(te_ids) > len(local_ids):  # equal up to the local EOD, yet TE went on
            problems.append(f"TE generated {len(te_ids)} ids, the local build {len(local_ids)} "
                            f"with all of them equal: {te_ids} vs {local_ids}")
    numbers = {"max_abs_diff": diff, "at_position_id": list(at), "rms_local": rms, "atol": atol,
               "tolerance_x_rms": TE_LOGITS_TOL, "positions": shape[0], "vocab": shape[1],
               "ids_compared": compared, "near_tie_at": near_tie, "top2_margins": margins}
    equal = "bitwise equal" if diff == 0 else f"{diff / rms:.1e} x RMS"
    detail = (f"teacher-forced fp32 logits ({shape[0]} positions x {shape[1]} ids): max |TE - "
              f"local| {diff:.2e} ({equal}; tolerance {TE_LOGITS_TOL:g} x RMS {rms:.3g} = "
              f"{atol:.2e}); greedy ids equal the local build's at {compared} of "
              f"{len(local_ids)}" + (f" (near-tie at id {near_tie}: local top-2 margin "
                                     f"{margins[-1]:.2e} <= 2 x tolerance, not compared from "
                                     f"there)" if near_tie else ""))
    return not problems, "; ".join(problems) or detail, numbers


def throughput(r: dict, warmup: int, peak: float | None) -> dict:
    """Means over the steps after ``warmup``: forward+backward (CUDA events) and optimizer
    milliseconds, tokens/s over the whole step, and the achieved FLOP/s and MFU of the
    forward+backward pass (FLOPs: megaloop.training.metrics.flops_per_iteration)."""
    timed = r["ms"][warmup:]
    mean = lambda key: sum(m[key] for m in timed) / len(timed)  # noqa: E731
    fwd_bwd, optim, step = mean("fwd_bwd"), mean("optim"), mean("step")
    flops = r["flops_per_iter"] / (fwd_bwd / 1e3)
    return {"timed_steps": len(timed), "fwd_bwd_ms": fwd_bwd, "optim_ms": optim,
            "step_ms": step, "tokens_per_s": r["tokens_per_iter"] / (step / 1e3),
            "tflops_fwd_bwd": flops / 1e12, "mfu_fwd_bwd": flops / peak if peak else None,
            "mem_gib": r["mem_gib"], "layout": r["layout"]}


def peak_flops(device_name: str, override: str | None) -> float | None:
    if override:
        return float(override) * 1e12
    for key, peak in PEAK_BF16:
        if key in (device_name or ""):
            return peak
    return None
