"""The one GPU check behind tools/gpu_check.sh: every GPU-only path of megaloop in one short run,
one table, exit status non-zero on any failed check.

    bash tools/gpu_check.sh                 # (= python tools/gpu_checks.py run)

Checks, in order (one rank per GPU, each launch a fresh torchrun process, not the test harness):

1. Transformer Engine imports (and megatron-core's TE extension with it).
2. ``--reset-attention-mask`` with TE is refused by validation (TE's causal attention reads no
   explicit mask, megaloop refuses the combination rather than mask nothing).
3. bf16 TE training smoke: ``pretrain_looplm.py`` at T=3, mock data, 5 iterations, evaluation,
   save; a second launch loads the checkpoint and trains 2 more.
4. TE vs local gradients at T=3 (``grads`` below, one torchrun rank): for each variant (Ouro
   norms; + stepwise LoRA; + AdaLN timestep conditioning; post-norm) the model is built twice,
   ``--transformer-impl local`` and ``transformer_engine``, from the same seed; the local weights
   are copied into the TE model (TE's fused norm weights renamed), both take one training step on
   the same batch in fp32 and loss and every gradient are compared with TF32 tolerances. Whether
   the two builds already had equal initial weights is its own row.
5. ``pytest -m gpu tests`` (multi-GPU tests skip themselves on fewer GPUs).
6. Throughput (``throughput`` below, one torchrun rank): a ~1B-shape looped model (6 layers x T=4,
   hidden 2048, 16 heads, SwiGLU 5632, seq 2048) against its unrolled dense twin (24 layers,
   T=1), BF16 and FP8: tokens/s and MFU, FLOPs counted on the layers applied
   (megaloop.training.metrics.flops_per_iteration, as the trainer logs them); the looped/dense MFU
   ratio (goal >= 0.98) and the FP8/BF16 speed-up (goal >= 1.3) are checks too. FP8 rows are
   skipped with "fp8 flags unavailable" when ``pretrain_looplm.py --help`` has no --fp8-format.

Without a GPU, the checks that can run on CPU run (the refusal, with validation told a GPU
exists; the FP8 flag probe) and every other row reads "no GPU: skipped"; the exit status is 0.

Environment: PYTHON (interpreter; default the running one), GPU_CHECK_BUDGET_S (default 570),
GPU_CHECK_PEAK_TFLOPS (the GPU's dense BF16 peak, when its name is not in PEAK_BF16),
GPU_CHECK_FP8_ARGS (default "--fp8-format hybrid --fp8-recipe tensorwise").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.environ.get("PYTHON") or sys.executable
NO_GPU = "no GPU: skipped"
FP8_UNAVAILABLE = "fp8 flags unavailable"
DEFAULT_FP8_ARGS = "--fp8-format hybrid --fp8-recipe tensorwise"
MFU_RATIO_GOAL = 0.98
FP8_SPEEDUP_GOAL = 1.3
# Dense (no sparsity) BF16 tensor-core peak per GPU, FLOP/s; FP8 is twice this. Matched against
# torch.cuda.get_device_name() in order (PCIe/NVL parts before the SXM default).
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
             ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12)]

# Small model of the smoke and gradient checks (flags of pretrain_looplm.py).
TINY = ["--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--disable-bias-linear",
        "--lr-decay-style", "cosine", "--eval-iters", "10", "--num-workers", "0",
        "--num-layers", "2", "--num-loops", "3", "--hidden-size", "128",
        "--num-attention-heads", "4", "--ffn-hidden-size", "352", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--lr", "1e-3",
        "--log-interval", "1"]
VARIANTS = {
    "ouro": ["--norm-scheme", "ouro"],
    "ouro+lora": ["--norm-scheme", "ouro", "--lora-rank", "4"],
    "ouro+adaln": ["--norm-scheme", "ouro", "--timestep-conditioning", "adaln"],
    "post": ["--norm-scheme", "post"],
}
# TF32 tolerances (TE runs fp32 GEMMs in TF32; the local spec in fp32): max |g_te - g_local|
# over max |g_local| per tensor, and the loss relative. The hazard this guards (TE linears
# overwriting instead of accumulating weight gradients across the T calls, Megatron-LM PR #6965)
# leaves the core's weight gradients at one step's share: relative errors ~0.5.
GRAD_RTOL = 3e-2
LOSS_RTOL = 5e-3
# The ~1B shape of the throughput table: 6 x 4 looped against 24 x 1 dense.
BIG = ["--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "5632",
       "--swiglu", "true", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear", "true",
       "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "2",
       "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer",
       "--vocab-size", "32000", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
       "--lr", "1e-4", "--bf16", "--transformer-impl", "transformer_engine", "--eval-iters", "0"]
LOOPED = ["--num-layers", "6", "--num-loops", "4", "--exit-loss", "last"]
DENSE = ["--num-layers", "24", "--num-loops", "1"]


# =============================================================================================
# The table
# =============================================================================================
@dataclass
class Row:
    check: str
    status: str  # PASS, FAIL, SKIP, INFO
    detail: str = ""
    seconds: float | None = None


@dataclass
class Report:
    rows: list = field(default_factory=list)

    def add(self, check, status, detail="", seconds=None):
        self.rows.append(Row(check, status, detail, seconds))
        print(f"[gpu_check] {status:4s} {check}: {detail}", file=sys.stderr, flush=True)

    @property
    def failed(self):
        return [r for r in self.rows if r.status == "FAIL"]

    def table(self) -> str:
        lines = ["| check | status | detail | s |", "|---|---|---|---|"]
        for r in self.rows:
            secs = "" if r.seconds is None else f"{r.seconds:.0f}"
            lines.append(f"| {r.check} | {r.status} | {r.detail.replace('|', '/')} | {secs} |")
        return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, timeout):
    cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(_free_port()), *args]
    return _run(cmd, timeout)


def _run(cmd, timeout, env=None):
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(timeout, 1), env=env)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        out, rc = out + f"\n[timed out after {timeout:.0f} s]", 124
    return rc, out, time.time() - start


def _tail(text, n=300):
    text = " ".join(text.strip().split())
    return text[-n:]


def _records(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def fp8_flags_available() -> bool:
    rc, out, _ = _run([PY, os.path.join(ROOT, "pretrain_looplm.py"), "--help"], 120)
    return rc == 0 and "--fp8-format" in out


def gpu_info():
    """(GPU count, name) without initialising CUDA in this process."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except Exception:
        return 0, ""
    if not torch.cuda.is_available():
        return 0, ""
    rc, out, _ = _run([PY, "-c", "import torch; print(torch.cuda.get_device_name(0))"], 120)
    return torch.cuda.device_count(), out.strip().splitlines()[-1] if rc == 0 and out else "?"


# =============================================================================================
# The checks (orchestrator side)
# =============================================================================================
def check_refusal(report, gpus, timeout):
    flags = [*TINY, "--train-iters", "1", "--transformer-impl", "transformer_engine",
             "--reset-attention-mask"]
    expected = "--reset-attention-mask with the Transformer Engine layer spec"
    if gpus:
        rc, out, secs = _run([PY, os.path.join(ROOT, "pretrain_looplm.py"), *flags], timeout)
        where = "pretrain_looplm.py on the GPU"
    else:
        # Validation is what refuses it; on CPU, tell it a GPU exists (nothing else runs).
        code = ("import sys, torch; torch.cuda.is_available = lambda: True; "
                "sys.path.insert(0, %r); import pretrain_looplm; "
                "sys.exit(pretrain_looplm.main(%r))" % (ROOT, flags))
        rc, out, secs = _run([PY, "-c", code], timeout)
        where = "CPU: validation with a GPU simulated"
    if rc == 2 and expected in out:
        report.add("reset-attention-mask with TE refused", "PASS",
                   f"exit 2 before any process group ({where})", secs)
    else:
        report.add("reset-attention-mask with TE refused", "FAIL",
                   f"rc {rc} ({where}): {_tail(out)}", secs)


def check_te_import(report, timeout):
    code = ("import transformer_engine as te; "
            "import megatron.core.extensions.transformer_engine as ext; print(te.__version__)")
    rc, out, secs = _run([PY, "-c", code], timeout)
    ok = rc == 0
    report.add("Transformer Engine imports", "PASS" if ok else "FAIL",
               f"transformer_engine {out.strip().splitlines()[-1]}" if ok else _tail(out), secs)
    return ok


def check_smoke(report, tmp, timeout):
    ckpt, log = os.path.join(tmp, "smoke_ckpt"), os.path.join(tmp, "smoke.jsonl")
    flags = [os.path.join(ROOT, "pretrain_looplm.py"), *TINY, "--transformer-impl",
             "transformer_engine", "--bf16", "--eval-interval", "5", "--eval-iters", "2",
             "--save", ckpt, "--save-interval", "5", "--log-jsonl", log]
    rc, out, secs = _torchrun([*flags, "--train-iters", "5"], timeout / 2)
    recs = _records(log)
    train = [r for r in recs if r["split"] == "train"]
    problems = []
    if rc != 0:
        problems.append(f"rc {rc}: {_tail(out)}")
    if [r["iteration"] for r in train] != [1, 2, 3, 4, 5]:
        problems.append(f"train iterations {[r['iteration'] for r in train]}")
    if not all(math.isfinite(r["loss"]) and len(r["step_losses"]) == 3 for r in train):
        problems.append("non-finite loss or not 3 step losses")
    if not any(r["split"] == "valid" for r in recs):
        problems.append("no evaluation record")
    if not os.path.exists(os.path.join(ckpt, "iter_0000005")):
        problems.append("no checkpoint iter_0000005")
    report.add("bf16 TE smoke: T=3, 5 iterations, eval, save", "FAIL" if problems else "PASS",
               "; ".join(problems) or f"loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}",
               secs)
    if problems:
        report.add("bf16 TE smoke: load and continue", "FAIL", "no checkpoint to load")
        return
    rc, out, secs = _torchrun([*flags, "--load", ckpt, "--train-iters", "7"], timeout / 2)
    more = [r for r in _records(log) if r["split"] == "train"][len(train):]
    problems = []
    if rc != 0:
        problems.append(f"rc {rc}: {_tail(out)}")
    if f"loaded {ckpt}/iter_0000005" not in out:
        problems.append("no 'loaded .../iter_0000005' line")
    if [r["iteration"] for r in more] != [6, 7] or not all(math.isfinite(r["loss"]) for r in more):
        problems.append(f"iterations after load {[r['iteration'] for r in more]}")
    report.add("bf16 TE smoke: load and continue", "FAIL" if problems else "PASS",
               "; ".join(problems) or f"resumed at 5, loss {more[-1]['loss']:.3f} at 7", secs)


def check_grads(report, tmp, timeout):
    out_path = os.path.join(tmp, "grads.json")
    rc, out, secs = _torchrun([os.path.abspath(__file__), "grads", "--out", out_path], timeout)
    if not os.path.exists(out_path):
        for name in VARIANTS:
            report.add(f"TE vs local grads, T=3: {name}", "FAIL", f"rc {rc}: {_tail(out)}", secs)
        return
    results = json.load(open(out_path))
    for name in VARIANTS:
        r = results.get(name)
        if r is None:
            report.add(f"TE vs local grads, T=3: {name}", "FAIL", "did not run", secs)
        elif "error" in r:
            report.add(f"TE vs local grads, T=3: {name}", "FAIL", _tail(r["error"]), secs)
        else:
            report.add(f"TE vs local grads, T=3: {name}", "PASS" if r["ok"] else "FAIL",
                       r["detail"], secs)
    inits = {k: v["init_max_diff"] for k, v in results.items() if "init_max_diff" in v}
    if inits:
        worst = max(inits.values())
        report.add("TE/local equal initial weights (same seed)",
                   "PASS" if worst == 0 else "FAIL",
                   "bitwise equal in every variant" if worst == 0 else
                   f"max |diff| {worst:.3g} ({', '.join(f'{k} {v:.2g}' for k, v in inits.items())}"
                   f"); the gradient rows copy the local weights in first", None)


def check_pytest(report, timeout):
    rc, out, secs = _run([PY, "-m", "pytest", "-m", "gpu", "tests", "-q", "-rfEs",
                          "-p", "no:cacheprovider"], timeout)
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    detail = summary[-1].strip("= ") if summary else _tail(out)
    ok = rc == 0 and "passed" in detail
    report.add("pytest -m gpu tests", "PASS" if ok else "FAIL",
               detail if ok else f"rc {rc}: {detail}; {_tail(out, 400)}", secs)


def check_throughput(report, tmp, timeout, fp8_args):
    out_path = os.path.join(tmp, "throughput.json")
    args = [os.path.abspath(__file__), "throughput", "--out", out_path]
    if fp8_args:
        args += ["--fp8-args", fp8_args]
    rc, out, secs = _torchrun(args, timeout)
    results = json.load(open(out_path)) if os.path.exists(out_path) else {}
    rows = {}
    for model in ("looped", "dense"):
        for prec in ("bf16", "fp8"):
            label = f"throughput {model} {prec}"
            r = results.get(f"{model}-{prec}")
            if prec == "fp8" and not fp8_args:
                report.add(label, "SKIP", FP8_UNAVAILABLE)
            elif r is None:
                report.add(label, "FAIL", f"did not run (rc {rc}): {_tail(out)}", secs)
            elif "error" in r:
                report.add(label, "FAIL", _tail(r["error"]))
            else:
                rows[(model, prec)] = r
                mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
                report.add(label, "INFO",
                           f"{r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.0f} TFLOP/s, MFU {mfu} "
                           f"(of BF16 peak), {r['ms_per_iter']:.0f} ms/iter, "
                           f"{r['mem_gib']:.1f} GiB, {r['layout']}")
    for prec in ("bf16", "fp8"):
        a, b = rows.get(("looped", prec)), rows.get(("dense", prec))
        label = f"looped/dense MFU {prec} (goal >= {MFU_RATIO_GOAL})"
        if a and b:
            ratio = a["tflops"] / b["tflops"]
            report.add(label, "PASS" if ratio >= MFU_RATIO_GOAL else "FAIL", f"{ratio:.3f}")
        else:
            report.add(label, "SKIP" if prec == "fp8" and not fp8_args else "FAIL",
                       FP8_UNAVAILABLE if prec == "fp8" and not fp8_args else "a row is missing")
    for model in ("looped", "dense"):
        a, b = rows.get((model, "fp8")), rows.get((model, "bf16"))
        label = f"FP8/BF16 speed-up {model} (goal >= {FP8_SPEEDUP_GOAL})"
        if not fp8_args:
            report.add(label, "SKIP", FP8_UNAVAILABLE)
        elif a and b:
            up = a["tokens_per_s"] / b["tokens_per_s"]
            report.add(label, "PASS" if up >= FP8_SPEEDUP_GOAL else "FAIL", f"{up:.2f}x")
        else:
            report.add(label, "FAIL", "a row is missing")


def run_all(budget_s: float) -> int:
    start = time.time()
    report = Report()
    left = lambda: budget_s - (time.time() - start)  # noqa: E731
    gpus, name = gpu_info()
    fp8 = fp8_flags_available()
    fp8_args = os.environ.get("GPU_CHECK_FP8_ARGS", DEFAULT_FP8_ARGS) if fp8 else ""
    report.add("FP8 flags in pretrain_looplm.py --help", "INFO",
               "--fp8-format present" if fp8 else FP8_UNAVAILABLE)
    if not gpus:
        report.add("Transformer Engine imports", "SKIP", NO_GPU)
        check_refusal(report, 0, 180)
        for check in ("bf16 TE smoke: T=3, 5 iterations, eval, save",
                      "bf16 TE smoke: load and continue",
                      *(f"TE vs local grads, T=3: {v}" for v in VARIANTS),
                      "pytest -m gpu tests",
                      *(f"throughput {m} {p}" for m in ("looped", "dense") for p in ("bf16", "fp8")),
                      f"looped/dense MFU (goal >= {MFU_RATIO_GOAL})",
                      f"FP8/BF16 speed-up (goal >= {FP8_SPEEDUP_GOAL})"):
            report.add(check, "SKIP", NO_GPU)
        print(f"\nmegaloop GPU check: {NO_GPU} (no CUDA device; only the CPU-runnable checks "
              f"ran)\n")
        print(report.table())
        return 1 if report.failed else 0

    with tempfile.TemporaryDirectory(prefix="megaloop_gpu_check_") as tmp:
        te = check_te_import(report, min(120, left()))
        check_refusal(report, gpus, min(120, left()))
        steps = [("smoke", lambda t: check_smoke(report, tmp, t), 150),
                 ("grads", lambda t: check_grads(report, tmp, t), 150),
                 ("throughput", lambda t: check_throughput(report, tmp, t, fp8_args), 200),
                 ("pytest", lambda t: check_pytest(report, t), 240)]
        if not te:
            steps = [s for s in steps if s[0] == "pytest"]
            report.add("TE checks", "FAIL", "skipped: Transformer Engine does not import")
        for i, (label, fn, cap) in enumerate(steps):
            # Leave every later step at least a minute of the budget.
            t = min(cap, left() - 60 * (len(steps) - i - 1))
            if t < 30:
                report.add(label, "FAIL", f"out of time (budget {budget_s:.0f} s)")
                continue
            fn(t)
    print(f"\nmegaloop GPU check: {gpus} x {name}, {time.time() - start:.0f} s\n")
    print(report.table())
    return 1 if report.failed else 0


# =============================================================================================
# Workers: one rank under torchrun (or a rank of the test harness on CPU)
# =============================================================================================
def _unwrap_names(model):
    for name, p in model.named_parameters():
        while name.startswith("module."):
            name = name[len("module."):]
        yield name, p


# TE fuses the input norms into the next linear; the local spec keeps them as modules.
TE_TO_LOCAL = [(".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
               (".self_attention.linear_qkv.layer_norm_bias", ".input_layernorm.bias"),
               (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
               (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias")]


def local_name(name: str) -> str:
    """The local spec's name of a parameter of either spec."""
    for te, local in TE_TO_LOCAL:
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def _build(flags, world_size=1):
    from megaloop.parallel.initialize import set_seed
    from megaloop.training.run_config import parse_args
    from megaloop.training.trainer import Trainer

    cfg = parse_args(flags)
    cfg.validate(world_size=world_size)
    set_seed(cfg.training.seed)  # the same RNG state before every build
    return cfg, Trainer(cfg)


def grads_compare(impl_a="local", impl_b="transformer_engine", variants=None) -> dict:
    """Per variant: build with impl_a and impl_b from one seed, copy a's weights into b, one
    step each, compare loss and gradients. Needs megatron-core's parallel state (TP=1)."""
    import torch

    results = {}
    for name in variants or VARIANTS:
        try:
            base = [*TINY, *VARIANTS[name], "--train-iters", "2", "--eval-iters", "0"]
            _, a = _build([*base, "--transformer-impl", impl_a])
            _, b = _build([*base, "--transformer-impl", impl_b])
            pa = {local_name(n): p for n, p in _unwrap_names(a.model)}
            pb = {local_name(n): p for n, p in _unwrap_names(b.model)}
            if pa.keys() != pb.keys():
                raise AssertionError(f"parameter names differ: only {impl_a}: "
                                     f"{sorted(pa.keys() - pb.keys())}, only {impl_b}: "
                                     f"{sorted(pb.keys() - pa.keys())}")
            init = max((pa[k].detach().float().cpu() - pb[k].detach().float().cpu())
                       .abs().max().item() for k in pa)
            with torch.no_grad():
                for k in pa:
                    pb[k].copy_(pa[k])
            stats_a, _, ok_a = a.train_step()
            stats_b, _, ok_b = b.train_step()
            assert ok_a and ok_b, "optimizer step skipped"

            def grad(p):
                g = getattr(p, "main_grad", None)
                return (g if g is not None else p.grad).detach().float().cpu()

            worst, worst_key, missing = 0.0, "", []
            for k in pa:
                if not pa[k].requires_grad:
                    continue
                ga, gb = grad(pa[k]), grad(pb[k])
                scale = ga.abs().max().item()
                err = (ga - gb).abs().max().item() / max(scale, 1e-8)
                if scale == 0 and gb.abs().max().item() == 0:
                    err = 0.0
                if err > worst:
                    worst, worst_key = err, k
            loss_err = abs(stats_a["loss"] - stats_b["loss"]) / abs(stats_a["loss"])
            steps_err = max(abs(x - y) / abs(x) for x, y in
                            zip(stats_a["step_losses"], stats_b["step_losses"], strict=True))
            ok = worst <= GRAD_RTOL and loss_err <= LOSS_RTOL and steps_err <= LOSS_RTOL
            results[name] = {
                "ok": ok, "init_max_diff": init, "grad_rel_err": worst, "loss_rel_err": loss_err,
                "detail": (f"loss {stats_a['loss']:.4f} vs {stats_b['loss']:.4f} (rel "
                           f"{loss_err:.1e}, steps {steps_err:.1e}); {len(pa)} grads, worst rel "
                           f"{worst:.1e} ({worst_key or '-'}); tol {GRAD_RTOL:g}/{LOSS_RTOL:g}"
                           + ("" if not missing else f"; missing {missing}"))}
            del a, b, pa, pb
        except Exception:
            import traceback

            results[name] = {"error": traceback.format_exc()}
        finally:
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return results


def _peak_flops(device_name: str):
    if os.environ.get("GPU_CHECK_PEAK_TFLOPS"):
        return float(os.environ["GPU_CHECK_PEAK_TFLOPS"]) * 1e12
    for key, peak in PEAK_BF16:
        if key in device_name:
            return peak
    return None


def throughput(fp8_args: str = "", base=None, shapes=None, warmup=3, iters=10) -> dict:
    """tokens/s, achieved FLOP/s (on the layers applied) and MFU of looped vs dense, BF16 and
    (with fp8_args) FP8, each built in this process in turn."""
    import gc

    import torch

    from megaloop.training.metrics import flops_per_iteration

    base = BIG if base is None else base
    shapes = shapes or {"looped": LOOPED, "dense": DENSE}
    on_gpu = torch.cuda.is_available()
    peak = _peak_flops(torch.cuda.get_device_name()) if on_gpu else None
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results = {}
    for prec, extra in (("bf16", []), ("fp8", shlex.split(fp8_args))):
        if prec == "fp8" and not fp8_args:
            continue
        for model, layout in shapes.items():
            key = f"{model}-{prec}"
            try:
                cfg, trainer = _build([*base, *layout, *extra,
                                       "--train-iters", str(warmup + iters)])
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(warmup):
                    trainer.train_step()
                sync()
                start = time.time()
                for _ in range(iters):
                    trainer.train_step()
                sync()
                elapsed = (time.time() - start) / iters
                tr = cfg.training
                gbs = trainer.gbs
                flops = flops_per_iteration(cfg.model, cfg.loop, trainer.tokenizer.vocab_size,
                                            tr.seq_length, gbs)
                loop = cfg.loop
                results[key] = {
                    "tokens_per_s": gbs * tr.seq_length / elapsed, "ms_per_iter": 1e3 * elapsed,
                    "tflops": flops / elapsed / 1e12,
                    "mfu": flops / elapsed / peak if peak else None,
                    "mem_gib": (torch.cuda.max_memory_allocated() / 2**30) if on_gpu else 0.0,
                    "layout": (f"{loop.num_core_layers(cfg.model.num_layers)} x {loop.num_loops}"
                               f" = depth {loop.effective_depth(cfg.model.num_layers)}")}
                del trainer
            except Exception:
                import traceback

                results[key] = {"error": traceback.format_exc()}
            finally:
                gc.collect()
                if on_gpu:
                    torch.cuda.empty_cache()
    return results


def _worker_init():
    """One torchrun rank: megatron-core's parallel state at TP=1 (the checks' builds share it)."""
    from megaloop import cpu_shim, runtime
    from megaloop.parallel.config import ParallelConfig
    from megaloop.parallel.initialize import initialize

    runtime.quiet_megatron()
    cpu_shim.enable()  # a no-op on a GPU machine
    initialize(ParallelConfig(), 1234)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("run", help="all checks, one table (what tools/gpu_check.sh runs)")
    g = sub.add_parser("grads", help="worker: TE vs local gradients (one torchrun rank)")
    g.add_argument("--out", required=True)
    g.add_argument("--impl-a", default="local")
    g.add_argument("--impl-b", default="transformer_engine")
    t = sub.add_parser("throughput", help="worker: looped vs dense tokens/s and MFU")
    t.add_argument("--out", required=True)
    t.add_argument("--fp8-args", default="")
    args = parser.parse_args(argv)
    if args.cmd in (None, "run"):
        return run_all(float(os.environ.get("GPU_CHECK_BUDGET_S", "570")))
    _worker_init()
    if args.cmd == "grads":
        results = grads_compare(args.impl_a, args.impl_b)
    else:
        results = throughput(args.fp8_args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for k, v in results.items():
        print(k, v.get("error") or {x: y for x, y in v.items() if x != "error"}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
